# The TensorFlow tutorial "Multi-worker training with Keras", file `main.py`,
# unchanged. Run it as a 2-worker cluster on this machine with
#
#   tfscale-launch --num_workers 2 --keras_compat -- python main.py
#
# (`--keras_compat` applies tfscale's Keras 3 fixes for this strategy without
# touching this file: `fit` works under MultiWorkerMirroredStrategy, and clipping
# and loss means give one device's numbers; see docs/launch.md, `--keras_compat`.)
import json
import os

import mnist_setup
import tensorflow as tf

per_worker_batch_size = 64
tf_config = json.loads(os.environ["TF_CONFIG"])
num_workers = len(tf_config["cluster"]["worker"])

strategy = tf.distribute.MultiWorkerMirroredStrategy()

global_batch_size = per_worker_batch_size * num_workers
multi_worker_dataset = mnist_setup.mnist_dataset(global_batch_size)

with strategy.scope():
    # Model building/compiling need to be within `strategy.scope()`.
    multi_worker_model = mnist_setup.build_and_compile_cnn_model()


multi_worker_model.fit(multi_worker_dataset, epochs=3, steps_per_epoch=70)
