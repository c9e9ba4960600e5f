"""tfscale.callbacks.StepTimer: its figure bracketed by wall times measured here.

A callback listed before the timer sleeps `SLEEP` seconds after every batch callback, so
the interval the timer measures (end of the first batch callback to end of the last)
holds at least one sleep per timed batch callback: that bounds the rate above. The
interval lies inside the epoch, timed here from `on_epoch_begin` to `on_epoch_end`: that
bounds it below. Keras calls batch callbacks once per `steps_per_execution` steps, so a
timer that counted calls instead of steps would fall under the lower bound.
"""

import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.callbacks import StepTimer
from tfscale.strategies import get

SLEEP = 0.2  # long against a step, so the two bounds lie close
BATCH = 32
CALLS = 8  # batch callbacks per epoch
EPOCHS = 2


class _SlowBatchesAndEpochClock(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch_seconds = []
        self.batch_calls = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.batch_calls += 1
        time.sleep(SLEEP)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_seconds.append(time.perf_counter() - self._start)


# steps_per_execution > 1 on one device: under MirroredStrategy Keras 3.15.1 / TF 2.21 fails
# in `fit` itself ("You must feed a value for placeholder tensor ... while/cond"), stock or patched.
@pytest.mark.parametrize(
    ("name", "options", "steps_per_execution"),
    [("mirrored", {"cpu_replicas": 2}, 1), ("one_device", {"device": "/cpu:0"}, 4)],
)
def test_throughput_lies_between_bounds_from_measured_wall_time(name, options, steps_per_execution):
    strategy = get(name, **options)
    replicas = strategy.num_replicas_in_sync
    with strategy.scope():
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)])
        model.compile(
            "sgd",
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    steps = CALLS * steps_per_execution
    x, y = np.ones((steps * BATCH, 8), "float32"), np.zeros(steps * BATCH, "int64")
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    clock = _SlowBatchesAndEpochClock()
    timer = StepTimer(BATCH, num_replicas=replicas, steps_per_execution=steps_per_execution)
    history = model.fit(ds, epochs=EPOCHS, callbacks=[clock, timer], verbose=0, shuffle=False)

    assert clock.batch_calls == EPOCHS * CALLS  # Keras calls back once per execution
    timed_steps = (CALLS - 1) * steps_per_execution  # the first call only starts the clock
    upper = steps_per_execution * BATCH / SLEEP  # each timed call holds at least one sleep
    rates = history.history["examples_per_sec"]
    for rate, seconds in zip(rates, clock.epoch_seconds):
        assert timed_steps * BATCH / seconds <= rate <= upper
    np.testing.assert_allclose(history.history["examples_per_sec_per_replica"], np.array(rates) / replicas)
    overall = timed_steps * EPOCHS * BATCH / sum(clock.epoch_seconds)
    assert overall <= timer.throughput <= upper
