"""Tiny training runs for the backup tests, chaos and bench scripts (in-process, subprocess, cluster).

A run trains a small dropout MLP for a few epochs (~50 steps, well under a second after
TensorFlow's import) with `BackupAndRestore` and optional `FailAt`, and returns its
final weights and how many steps it actually ran. As a script:

    python tests/_backup_workers.py '{"backup_dir": "/tmp/b", "out": "/tmp/r.pkl", ...}'
"""

import json
import logging
import os
import pickle
import sys

__all__ = [
    "build_model",
    "cluster_train",
    "flip_byte",
    "listing",
    "main",
    "make_data",
    "step_counter",
    "train",
]

NUM_SAMPLES, FEATURES = 128, 8


def make_data(dataset, batch_size, samples=NUM_SAMPLES):
    """`(x, y)` arrays, or a tf.data pipeline that reshuffles on every iteration."""
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.1 * rng.normal(size=(samples, 1))).astype("float32")
    if dataset == "array":
        return {"x": x, "y": y, "batch_size": batch_size}
    if dataset == "tfdata_repeat":
        # One endless iterator that `fit` keeps across epochs (`steps_per_epoch` given).
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(samples, seed=7).repeat()
        return {"x": ds.batch(batch_size), "steps_per_epoch": samples // batch_size, "shuffle": False}
    if dataset == "tfdata_unknown":
        # A length tf.data cannot tell before the end (filter): Keras learns it at the end of epoch 0.
        ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True)
        return {"x": ds.batch(batch_size), "shuffle": False}
    if dataset == "tfdata_reshuffle":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(
            NUM_SAMPLES, seed=7, reshuffle_each_iteration=True
        )
        return {"x": ds.batch(batch_size), "shuffle": False}
    raise ValueError(f"unknown dataset {dataset!r}")


def listing(directory):
    """The sorted entries of `directory`, but the lock a `fit` that raised still holds there."""
    return sorted(n for n in os.listdir(directory) if n != ".tfscale-lock")


def flip_byte(path):
    """Corrupts a file in place: inverts its middle byte (its size stays the same)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _counter_class():
    import keras

    class StepCounter(keras.callbacks.Callback):
        """Counts the train steps `fit` actually ran in this process."""

        def __init__(self, print_steps=False):
            super().__init__()
            self.print_steps = print_steps
            self.steps = 0
            self.first_step_time = None

        def on_train_batch_begin(self, batch, logs=None):
            self._begin = batch

        def on_train_batch_end(self, batch, logs=None):
            import time

            self.first_step_time = self.first_step_time or time.monotonic()
            self.steps += batch - self._begin + 1
            if self.print_steps:
                # Flushed per step: a test reads the last step a killed process finished.
                print(f"tfscale-test global_step {int(self.model.optimizer.iterations.numpy())}", flush=True)

    return StepCounter


def step_counter(print_steps=False):
    """A fresh callback that counts the steps `fit` ran (`.steps`), optionally printing each."""
    return _counter_class()(print_steps)


def _strategy(name):
    import tfscale.strategies

    if name == "mirrored":
        return tfscale.strategies.get("mirrored", cpu_replicas=2)
    return tfscale.strategies.get(name)


def slow_backup_class(seconds, log=None, step_seconds=0.0):
    """`BackupAndRestore` whose store takes `seconds` longer per write (a real sleep in the
    real write), so that kills and steps land while a background write is in flight.
    `log`, if given, gets `(step, thread name)` per write. `step_seconds` makes each
    training step that much longer (a sleep as it starts): `async_save` overlaps a write
    with steps only when it takes fewer steps than `save_freq`."""
    import threading
    import time

    import tfscale.callbacks
    from tfscale.callbacks import _backup_store

    class SlowStore(_backup_store.BackupStore):
        def write(self, step, meta, arrays):
            if log is not None:
                log.append((step, threading.current_thread().name))
            time.sleep(seconds)
            return super().write(step, meta, arrays)

    class SlowBackup(tfscale.callbacks.BackupAndRestore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._store = SlowStore(self.backup_dir, self.max_to_keep)

        def on_train_batch_begin(self, batch, logs=None):
            super().on_train_batch_begin(batch, logs)
            time.sleep(step_seconds)

    return SlowBackup


def kill_mid_write_class(base, after_step, signum=None):
    """`base` (a `BackupAndRestore` class) whose writer sends its own process `signum`
    (default SIGKILL) at the first step end from `after_step` on at which a background
    write is in flight: a kill that loses the backup being written, on purpose."""
    import signal

    import tfscale.callbacks

    class KillMidWrite(base or tfscale.callbacks.BackupAndRestore):
        fired = False

        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            if self.fired or self._global_step < after_step or not self._task.is_writer:
                return
            if self._writer.busy():
                self.fired = True
                os.kill(os.getpid(), signum or signal.SIGKILL)

    return KillMidWrite


def _no_scope():
    import contextlib
    import types

    return types.SimpleNamespace(scope=contextlib.nullcontext)


def build_model(strategy, steps_per_execution=1, units=16, metrics=None):
    import keras

    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(units, activation="relu"),
                keras.layers.Dropout(0.25),
                keras.layers.Dense(1),
            ]
        )
        model.compile(
            keras.optimizers.Adam(1e-2), "mse", metrics=metrics, steps_per_execution=steps_per_execution
        )
    return model


def train(
    backup_dir,
    *,
    epochs=3,
    batch_size=8,
    save_freq=5,
    fail=None,
    strategy="one_device",
    stock=False,
    steps_per_execution=1,
    dataset="array",
    units=16,
    max_to_keep=None,
    delete_checkpoint=True,
    print_steps=False,
    samples=NUM_SAMPLES,
    async_save=None,
    callback_class=None,
    slow_write=0.0,
    slow_step=0.0,
    metrics=None,
    scoped=True,
    job_id=None,
    epoch_logs=None,
):
    """Trains once (resuming from `backup_dir` if it holds a backup); returns a result dict.

    `epoch_logs`, a list, gets `(epoch, logs)` at each epoch end (kept when `fit` raises:
    one list over a job's attempts holds the job's whole history).
    """
    import time

    import keras

    import tfscale.callbacks

    started = time.monotonic()
    strat = _strategy(strategy)
    if scoped:
        model = build_model(strat, steps_per_execution, units, metrics)
    else:  # no strategy scope: Keras builds the compiled metrics at the first step only
        model = build_model(_no_scope(), steps_per_execution, units, metrics)
    if stock:
        backup = keras.callbacks.BackupAndRestore(
            backup_dir, save_freq=save_freq, delete_checkpoint=delete_checkpoint
        )
    else:
        if (slow_write or slow_step) and callback_class is None:
            callback_class = slow_backup_class(slow_write, step_seconds=slow_step)
        if fail and "in_flight_after" in fail:
            callback_class = kill_mid_write_class(callback_class, fail["in_flight_after"])
            fail = None
        backup = (callback_class or tfscale.callbacks.BackupAndRestore)(
            backup_dir,
            save_freq=save_freq,
            max_to_keep=max_to_keep,
            delete_checkpoint=delete_checkpoint,
            **({} if async_save is None else {"async_save": async_save}),
            **({} if job_id is None else {"job_id": job_id}),
        )
    counter = step_counter(print_steps)
    # The counter goes first: it reports a finished step even when the backup callback then exits.
    callbacks = [counter, backup]
    if fail:
        callbacks.append(
            tfscale.callbacks.FailAt(
                fail["step"], fail["mode"], task=fail.get("task"), restart_count=fail.get("restart_count")
            )
        )
    if epoch_logs is not None:
        record = keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: epoch_logs.append((epoch, dict(logs)))
        )
        callbacks.append(record)
    data = make_data(dataset, batch_size, samples)
    history = model.fit(**data, epochs=epochs, callbacks=callbacks, verbose=0)
    return {
        "history": dict(history.history),
        "weights": [v.value.numpy() for v in model.weights],
        "steps_run": counter.steps,
        "restored": None if stock else backup.restored_from,
        "global_step": int(model.optimizer.iterations.numpy()),
        "seconds_to_first_step": None
        if counter.first_step_time is None
        else counter.first_step_time - started,
    }


def cluster_train(backup_dir, **kwargs):
    """`train` under `multi_worker` in each task of a `run_local_cluster`."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    return train(backup_dir, strategy="multi_worker", **kwargs)


def main(argv):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    config = json.loads(argv[1])
    out = config.pop("out")
    result = train(**config)
    with open(out + ".tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    main(sys.argv)
