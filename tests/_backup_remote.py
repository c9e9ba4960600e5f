"""A two-task TensorFlow cluster for the placed-shard backup tests (run as two processes).

    python tests/_backup_remote.py server PORT0 PORT1        # task 1: holds variables
    python tests/_backup_remote.py client PORT0 PORT1 JSON   # task 0: builds, fits, backs up

The client places the second Dense layer (and, by Keras's colocation, its optimizer
slots) on task 1, trains with `BackupAndRestore`, fails once, resumes in a fresh model,
and prints one JSON line with what the test checks.
"""

import json
import os
import sys

__all__ = ["main"]

REMOTE = "/job:worker/replica:0/task:1/device:CPU:0"


def _cluster(port0, port1):
    import tensorflow as tf

    return tf.train.ClusterSpec({"worker": [f"localhost:{port0}", f"localhost:{port1}"]})


def _server(port0, port1):
    import tensorflow as tf

    server = tf.distribute.Server(_cluster(port0, port1), job_name="worker", task_index=1, protocol="grpc")
    print("tfscale-test server ready", flush=True)
    server.join()


def _model():
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(3)
    first = keras.layers.Dense(16, activation="relu")
    first.build((None, 8))
    with tf.device(REMOTE):
        second = keras.layers.Dense(1)
        second.build((None, 16))
    model = keras.Sequential([keras.Input((8,)), first, second])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.optimizer.build(model.trainable_variables)
    return model


def _fit(model, callbacks):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, callbacks=callbacks)
    return [v.numpy() for v in model.variables + model.optimizer.variables]


def _client(port0, port1, options):
    import numpy as np
    import tensorflow as tf

    import tfscale.callbacks

    tf.config.experimental_connect_to_cluster(_cluster(port0, port1), job_name="worker", task_index=0)
    backup_dir = options["backup_dir"]
    reference = _fit(_model(), [])

    def backup():
        return tfscale.callbacks.BackupAndRestore(
            backup_dir, save_freq=4, max_to_keep=2, async_save=options["async_save"]
        )

    first = _model()
    try:
        _fit(first, [backup(), tfscale.callbacks.FailAt(10, mode="raise")])
    except tfscale.callbacks.InjectedFault:
        pass
    from tfscale.callbacks import _backup_store, _backup_writer

    _backup_writer.wait_for_directory(backup_dir)  # a write in flight when `fit` raised

    # ckpt-8 (backups at 4 and 8, the fit fails after 10); with async_save, snapshots come
    # earlier so that at most save_freq steps are at risk.
    newest = os.path.join(backup_dir, _backup_store.BackupStore(backup_dir, 2).published()[0])
    with open(os.path.join(newest, "manifest.json")) as f:
        shards = json.load(f)["shards"]
    placed = [s for s in shards if s["kind"] == "tensors"]
    result = {
        "newest_step": int(os.path.basename(newest).split("-")[1]),
        "devices": sorted({v.value.device for v in first.variables + first.optimizer.variables}),
        "shards": [{k: s[k] for k in ("file", "kind", "device", "variables")} for s in shards],
        "written_on": [s["written_on"] for s in placed],
        "placed_files_exist": [os.path.getsize(os.path.join(newest, s["file"])) > 0 for s in placed],
    }
    if options.get("damage_remote"):
        from _backup_workers import flip_byte  # beside this script

        flip_byte(os.path.join(newest, placed[0]["file"]))
    callback = backup()
    resumed = _fit(_model(), [callback])
    result["restored_step"] = callback.restored_from["global_step"]
    result["max_diff"] = max(float(np.abs(a - b).max()) for a, b in zip(resumed, reference))
    print("tfscale-test " + json.dumps(result), flush=True)


def main(argv):
    if argv[1] == "server":
        _server(argv[2], argv[3])
    else:
        _client(argv[2], argv[3], json.loads(argv[4]))


if __name__ == "__main__":
    main(sys.argv)
