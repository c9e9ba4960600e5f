"""Callback reporting how much of a training step the gradient all-reduce takes (from the profiler)."""

import json
import logging
import os
import time

import keras
import tensorflow as tf

from tfscale.compat import profiler_xplane

__all__ = ["CommunicationProfiler"]

_log = logging.getLogger("tfscale")


def _task_label(strategy):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None or not resolver.task_type:
        return "local"
    return f"{resolver.task_type}-{resolver.task_id}"


class CommunicationProfiler(keras.callbacks.Callback):
    """Callback to profile steps A..B of `fit` and report all-reduce time and launches.

    Runs `tf.profiler` only for the profiled steps (nothing outside them), then reads
    the trace it wrote: every `CollectiveReduceV2` launch and its duration. Writes
    `communication-<task>.json` under `log_dir` (the profiler's own trace, viewable in
    TensorBoard's profile tab, is under `log_dir/<task>/plugins/profile`) and logs one
    summary line, e.g. "all-reduce 31% of step time, 1.0 launches/step". The all-reduce
    time per step is the launches' summed duration divided by this worker's replicas
    (they run concurrently); it includes waiting for slower peers.

    Args:
        log_dir: where the JSON and the trace go.
        profile_steps: `(first, last)` batches (1-based, counted over the whole `fit`)
            to profile; profile after the first step so tracing is not counted.

    Raises:
        ValueError: `profile_steps` is not two integers 1 <= first <= last.

    Example:

    >>> profiler = CommunicationProfiler("/tmp/profile", profile_steps=(5, 10))
    >>> model.fit(ds, epochs=1, callbacks=[profiler])
    >>> profiler.report["allreduce_fraction"]
    """

    def __init__(self, log_dir, profile_steps=(2, 4)):
        super().__init__()
        steps = tuple(profile_steps) if isinstance(profile_steps, (tuple, list)) else ()
        if (
            len(steps) != 2
            or any(isinstance(s, bool) or not isinstance(s, int) for s in steps)
            or not (1 <= steps[0] <= steps[1])
        ):
            raise ValueError(
                "Invalid value for argument `profile_steps`. Received: "
                f"profile_steps={profile_steps!r}. Expected (first, last) integers with 1 <= first <= last."
            )
        self.log_dir = os.fspath(log_dir)
        self.profile_steps = steps
        self.report = None
        self._step, self._started = 0, None

    def on_train_begin(self, logs=None):
        self._step, self._started, self.report = 0, None, None

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        if self._step == self.profile_steps[0]:
            self._trace_dir = os.path.join(self.log_dir, _task_label(self.model.distribute_strategy))
            tf.profiler.experimental.start(self._trace_dir)
            self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._started is not None and self._step == self.profile_steps[1]:
            self._finish(self._step - self.profile_steps[0] + 1)

    def on_train_end(self, logs=None):
        if self._started is not None:  # `fit` ended inside the profiled range.
            self._finish(self._step - self.profile_steps[0] + 1)

    def _finish(self, steps):
        wall = time.perf_counter() - self._started
        tf.profiler.experimental.stop()
        self._started = None
        strategy = self.model.distribute_strategy
        local_replicas = len(strategy.extended.worker_devices)
        events = profiler_xplane.collective_events(profiler_xplane.latest_trace(self._trace_dir))
        allreduce_s = sum(e.duration_s for e in events) / local_replicas / steps
        step_s = wall / steps
        self.report = {
            "task": _task_label(strategy),
            "profiled_steps": [self.profile_steps[0], self.profile_steps[0] + steps - 1],
            "step_s": step_s,
            "allreduce_s_per_step": allreduce_s,
            "allreduce_fraction": allreduce_s / step_s,
            "allreduce_launches_per_step": len(events) / local_replicas / steps,
            "replicas_in_sync": strategy.num_replicas_in_sync,
        }
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"communication-{self.report['task']}.json"), "w") as f:
            json.dump(self.report, f, indent=1)
        _log.info(
            "tfscale: all-reduce %.0f%% of step time, %.1f launches/step (steps %d-%d, %s)",
            100 * self.report["allreduce_fraction"],
            self.report["allreduce_launches_per_step"],
            *self.report["profiled_steps"],
            self.report["task"],
        )
