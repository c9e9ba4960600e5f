"""Callback measuring training throughput: examples per second, global and per replica."""

import time

import keras

from tfscale.callbacks._errors import CallbackError

__all__ = ["StepTimer"]


class StepTimer(keras.callbacks.Callback):
    """Callback to measure examples per second, in total and per replica, each epoch.

    Each epoch's figure is timed from the end of its first batch to the end of its last,
    so tracing and compilation (first step) and the input pipeline's warm-up do not count.
    It is added to the epoch logs as `examples_per_sec` and `examples_per_sec_per_replica`,
    so `History`, the progress bar and a `TensorBoard` callback listed after this one
    record it (TensorBoard as `epoch_examples_per_sec`). `throughput` holds the figure
    over all epochs once training ends. Works with or without a strategy.

    Args:
        global_batch_size: examples per step over all replicas of all workers.
        num_replicas: replicas in sync (`strategy.num_replicas_in_sync`).
        steps_per_execution: steps per batch callback (the model's `steps_per_execution`).

    Raises:
        CallbackError: an argument is not a positive integer.

    Example:

    >>> timer = StepTimer(global_batch_size=256, num_replicas=strategy.num_replicas_in_sync)
    >>> model.fit(ds, epochs=3, callbacks=[timer, keras.callbacks.TensorBoard(log_dir)])
    >>> timer.throughput
    """

    def __init__(self, global_batch_size, num_replicas=1, steps_per_execution=1):
        super().__init__()
        for name, value in (
            ("global_batch_size", global_batch_size),
            ("num_replicas", num_replicas),
            ("steps_per_execution", steps_per_execution),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CallbackError(
                    f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
                    "Expected a positive integer."
                )
        self.global_batch_size = global_batch_size
        self.num_replicas = num_replicas
        self.steps_per_execution = steps_per_execution
        self.throughput = None
        self._total_steps = 0
        self._total_seconds = 0.0

    def on_epoch_begin(self, epoch, logs=None):
        self._start = None
        self._steps = 0

    def on_train_batch_end(self, batch, logs=None):
        now = time.perf_counter()
        if self._start is None:
            self._start = now  # The first batch (and its tracing) is not timed.
            return
        self._steps += self.steps_per_execution
        self._last = now

    def on_epoch_end(self, epoch, logs=None):
        if not self._steps:
            return
        seconds = self._last - self._start
        self._total_steps += self._steps
        self._total_seconds += seconds
        rate = self._steps * self.global_batch_size / seconds
        self.throughput = self._total_steps * self.global_batch_size / self._total_seconds
        if logs is not None:
            logs["examples_per_sec"] = rate
            logs["examples_per_sec_per_replica"] = rate / self.num_replicas
