"""Training runs compared by tests/test_compat_keras_optimizer.py (in-process and on clusters).

Each run trains the same model on the same data with one optimizer option set; the
single-device run with the same global batch is the reference.
"""

import numpy as np

GLOBAL_BATCH = 16
STEPS = 8
# Each option set is one Keras 3 optimizer feature that must mean the same under
# data parallelism as on one device. Clip thresholds are small enough to clip.
OPTIONS = {
    "plain": {},
    "clipnorm": {"clipnorm": 0.05},
    "global_clipnorm": {"global_clipnorm": 0.05},
    "clipvalue": {"clipvalue": 0.01},
    "weight_decay": {"weight_decay": 0.1},
    "ema": {"use_ema": True, "ema_momentum": 0.9, "ema_overwrite_frequency": 3},
    "accumulation": {"gradient_accumulation_steps": 2},
    "accumulation_clip": {"gradient_accumulation_steps": 4, "global_clipnorm": 0.05, "weight_decay": 0.1},
}


def data(steps=STEPS):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * GLOBAL_BATCH, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    return x, y


def build_model(optimizer_options, optimizer="adam"):
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    cls = {"adam": keras.optimizers.Adam, "sgd": keras.optimizers.SGD, "nadam": keras.optimizers.Nadam}[
        optimizer
    ]
    opt = cls(0.05, **optimizer_options)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def train(strategy, option="plain", epochs=2, callbacks=(), optimizer="adam"):
    """Trains under `strategy` with OPTIONS[option]; returns the final weights."""
    import tensorflow as tf

    x, y = data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = build_model(OPTIONS[option], optimizer)
    model.fit(dataset, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return [np.asarray(w) for w in model.get_weights()]


def multi_worker_runs(options, compressed_option="plain"):
    """In each task of a cluster: train every option of `options`, then one fp16-compressed run."""
    import os

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tfscale.strategies
    from tfscale.strategies import _communication

    strategy = tfscale.strategies.get("multi_worker")  # One MWMS per process, reused.
    weights = {option: train(strategy, option) for option in options}
    _communication.configure(strategy, gradient_compression="fp16")
    compressed = train(strategy, compressed_option)
    return {"replicas": strategy.num_replicas_in_sync, "weights": weights, "fp16": compressed}
