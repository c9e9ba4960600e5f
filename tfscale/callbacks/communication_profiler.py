"""Callback reporting how much of a training step the gradient all-reduce takes (from the profiler)."""

import glob
import json
import logging
import os
import time

import keras
import tensorflow as tf

from tfscale.callbacks import _step_split
from tfscale.callbacks._errors import CallbackError
from tfscale.cluster import ClusterSpec
from tfscale.compat import profiler_xplane, tf_barrier, tf_communication, tf_traceme_split

__all__ = ["CommunicationProfiler"]

_log = logging.getLogger("tfscale")
# Workers reach the same step within one all-reduce of each other; a peer that is gone
# fails the barrier at once (coordination service), so this bounds only a stuck peer.
_BARRIER_TIMEOUT_S = 300


def _task_label(strategy):
    """This task's file label ("worker-1", or "local"): ClusterSpec answers who this is."""
    return ClusterSpec.from_strategy(strategy).task_file_label


class CommunicationProfiler(keras.callbacks.Callback):
    """Callback to profile steps A..B of `fit` and report all-reduce time and launches.

    Runs `tf.profiler` only for the profiled steps (it is started at the first one and
    stopped after the last: nothing runs outside them), then reads the trace it wrote.
    Per step (a call of Keras's train function in the trace): time in input (waiting in
    the iterator's get_next), all-reduce (any replica inside a `CollectiveReduceV2`
    launch, waiting for slower peers included) and compute (the rest of the step, of which
    `host_s` had no op running: Python and dispatch); see `_step_split`. Writes, under
    `log_dir`: `communication-<task>.json` (the report below), `trace-<task>.json.gz`
    (a Chrome trace, for chrome://tracing or ui.perfetto.dev), on the chief
    `communication.png` (stacked bars per worker per step, from every worker's JSON in
    `log_dir`), and the profiler's own trace under `log_dir/<task>/plugins/profile`
    (TensorBoard's profile tab). Logs one summary line, e.g. "all-reduce 31% of step
    time, 0.71 MB/step in 1.00 launches; input 2%, compute 67%". `step_s` is the wall clock around
    the profiled steps, measured apart from the trace.

    Under `multi_worker` (TensorFlow 2.21, and any version not yet checked) only the chief
    (the collective group leader) runs the profiler: stopping it on another worker can crash
    that worker (a TensorFlow bug, see tfscale/compat/tf_traceme_split.py). The other
    workers still time the same steps and write their JSON with `"traced": false`, `step_s`
    and `allreduce_bytes_per_step`, and None for the parts read from a trace; the chief's
    split stands for theirs (the all-reduce keeps the workers in step, and its time includes
    waiting for the slowest).

    Args:
        log_dir: where the JSON and the trace go.
        profile_steps: `(first, last)` batches (1-based, counted over the whole `fit`)
            to profile; profile after the first step so tracing is not counted.

    Raises:
        CallbackError: `profile_steps` is not two integers 1 <= first <= last.

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
            raise CallbackError(
                "Invalid value for argument `profile_steps`. Received: "
                f"profile_steps={profile_steps!r}. Expected (first, last) integers with 1 <= first <= last."
            )
        self.log_dir = os.fspath(log_dir)
        self.profile_steps = steps
        self.report = None
        self._step, self._started, self._tracing = 0, None, False
        self._fits = 0  # `fit` calls so far: part of each barrier's name, the same on every worker

    def on_train_begin(self, logs=None):
        self._step, self._started, self.report = 0, None, None
        self._fits += 1

    def on_train_batch_begin(self, batch, logs=None):
        self._step += 1
        if self._step == self.profile_steps[0]:
            self._trace_dir = os.path.join(self.log_dir, _task_label(self.model.distribute_strategy))
            self._tracing = _may_trace(self.model.distribute_strategy)
            self._quiesce("start")
            if self._tracing:
                tf.profiler.experimental.start(self._trace_dir)
            self._started = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._started is not None and self._step == self.profile_steps[1]:
            self._finish(self._step - self.profile_steps[0] + 1)

    def on_train_end(self, logs=None):
        if self._started is not None:  # `fit` ended inside the profiled range.
            self._finish(self._step - self.profile_steps[0] + 1)

    def _quiesce(self, what):
        """Starts or stops the profiler only when no collective runs anywhere (`tf_barrier`)."""
        multi_worker = ClusterSpec.from_strategy(self.model.distribute_strategy).is_multi_worker
        tf_barrier.quiesce(
            f"tfscale-profiler-{what}-{self._fits}-{self._step}",
            multi_worker=multi_worker,
            timeout_s=_BARRIER_TIMEOUT_S,
        )

    def _finish(self, steps):
        wall = time.perf_counter() - self._started
        self._quiesce("stop")
        if self._tracing:
            tf.profiler.experimental.stop()
        self._started = None
        strategy = self.model.distribute_strategy
        step_s = wall / steps
        self.report = {
            "task": _task_label(strategy),
            "profiled_steps": [self.profile_steps[0], self.profile_steps[0] + steps - 1],
            "traced": self._tracing,
            "step_s": step_s,
            **{f"{k}_s_per_step": None for k in (*_step_split.KINDS, "host")},
            "allreduce_fraction": None,
            "allreduce_launches_per_step": None,
            "replicas_in_sync": strategy.num_replicas_in_sync,
            "allreduce_bytes_per_step": _gradient_bytes_per_step(self.model, strategy),
            "steps": [],
        }
        os.makedirs(self.log_dir, exist_ok=True)
        task = self.report["task"]
        if self._tracing:
            self._read_trace(steps, _local_replicas(strategy))
        with open(os.path.join(self.log_dir, f"communication-{task}.json"), "w") as f:
            json.dump(self.report, f, indent=1)
        spec = ClusterSpec.from_strategy(strategy)
        self._quiesce("written")  # every worker's JSON is on disk before the chief reads them
        if spec.is_writer or not spec.is_multi_worker:
            _plot_workers(self.log_dir)
        if not self._tracing:
            _log.info(
                "tfscale: %.3f s/step (steps %d-%d, %s; not traced: under multi_worker only the chief "
                "traces on this TensorFlow, see tfscale/compat/tf_traceme_split.py)",
                step_s,
                *self.report["profiled_steps"],
                task,
            )
            return
        per_step = {k: self.report[f"{k}_s_per_step"] for k in _step_split.KINDS}
        _log.info(
            "tfscale: all-reduce %.0f%% of step time, %.2f MB/step in %.2f launches; input %.0f%%, "
            "compute %.0f%% (steps %d-%d, %s)",
            100 * self.report["allreduce_fraction"],
            self.report["allreduce_bytes_per_step"] / 1e6,
            self.report["allreduce_launches_per_step"],
            100 * per_step["input"] / step_s,
            100 * per_step["compute"] / step_s,
            *self.report["profiled_steps"],
            task,
        )

    def _read_trace(self, steps, local_replicas):
        """Fills the report's split, launches and fraction from this task's trace; writes the Chrome trace."""
        path = profiler_xplane.latest_trace(self._trace_dir)
        events = profiler_xplane.trace_events(path)
        launches = profiler_xplane.collective_events(path)
        split = _step_split.split_steps(events)
        per_step = {f"{k}_s_per_step": _mean(split, f"{k}_s") for k in (*_step_split.KINDS, "host")}
        self.report.update(per_step, steps=split)
        self.report["allreduce_fraction"] = per_step["allreduce_s_per_step"] / self.report["step_s"]
        self.report["allreduce_launches_per_step"] = len(launches) / local_replicas / steps
        task = self.report["task"]
        _step_split.chrome_trace(events, os.path.join(self.log_dir, f"trace-{task}.json.gz"))


def _may_trace(strategy):
    """False on a worker that is not the collective group leader, where TF's profiler stop can crash.

    See tfscale/compat/tf_traceme_split.py: the leader is the chief (`ClusterSpec.is_chief`).
    """
    spec = ClusterSpec.from_strategy(strategy)
    return tf_traceme_split.may_trace(multi_worker=spec.is_multi_worker, collective_leader=spec.is_chief)


def _gradient_bytes_per_step(model, strategy):
    """Bytes each replica's gradient all-reduce sends per step (0 with one replica).

    TensorFlow's trace records no tensor sizes, so this is the trainable variables' size
    in the all-reduce dtype (the compression's, else the variable's), over the
    accumulation steps k: `tests/test_communication.py` checks the traced all-reduce
    sends exactly that, `tests/test_compat_profiler_xplane.py` that it runs once per k.
    """
    if strategy.num_replicas_in_sync < 2:
        return 0
    compressed = tf_communication.compression_dtype(strategy)
    size = sum(
        v.shape.num_elements() * (compressed or tf.as_dtype(v.dtype)).size for v in model.trainable_variables
    )
    return size / (getattr(model.optimizer, "gradient_accumulation_steps", None) or 1)


def _local_replicas(strategy):
    """Replicas in this process: the strategy's worker devices, else (default strategy) its replicas.

    The default strategy (one device, and the `pipeline` / `model_split` models that place
    their parts themselves) raises RuntimeError for `worker_devices`.
    """
    try:
        return len(strategy.extended.worker_devices)
    except RuntimeError:
        return strategy.num_replicas_in_sync


def _mean(steps, key):
    return sum(s[key] for s in steps) / len(steps) if steps else 0.0


def _plot_workers(log_dir):
    """On the chief: the stacked bars of every worker whose JSON is in `log_dir` (all written by now)."""
    reports = []
    for path in sorted(glob.glob(os.path.join(log_dir, "communication-*.json"))):
        with open(path) as f:
            report = json.load(f)
        if report.get("traced", True):  # an untraced worker has its step time, not its split
            reports.append(report)
    if reports:
        _step_split.plot(reports, os.path.join(log_dir, "communication.png"))
