"""`FailAt`: fault injection for tests and chaos runs (never use it in real training)."""

import os
import signal
import sys

import keras

from tfscale import _task_protocol
from tfscale.cluster import ClusterSpec
from tfscale.errors import Error

__all__ = ["FailAt", "FailAtError", "InjectedFault"]

_MODES = ("raise", "sigkill", "sigterm")


class FailAtError(Error):
    """Bad arguments for `FailAt`."""


class InjectedFault(RuntimeError):
    """The fault `FailAt(mode="raise")` injects."""


class FailAt(keras.callbacks.Callback):
    """Injects a fault once the run reaches a global step: for tests and chaos runs only.

    The global step is `model.optimizer.iterations` (restored from a backup, so it
    counts the steps of every attempt of the run). The fault fires in
    `on_train_batch_end` of the execution that reaches `step`, i.e. after `step`
    steps are done; put it after `BackupAndRestore` in `callbacks` so a backup due at
    that step is written first. A resumed run that starts past `step` never fires.

    Args:
        step: global step (>= 1) after which to fail.
        mode: `"raise"` (raise `InjectedFault`), `"sigkill"` (the process kills itself:
            no cleanup, like an OOM kill or a lost machine) or `"sigterm"` (the process
            sends itself SIGTERM, like a preemption notice).
        task: only fail in this task of a cluster, e.g. `("worker", 1)`; None: any.
        restart_count: only fail in this attempt of a `tfscale-launch` job, read from
            `TFSCALE_RESTART_COUNT` (0: the first attempt; unset counts as 0). With it a
            fault can sit between two backups: the restarted run replays that step
            without failing again. None: every attempt that reaches `step`.

    Raises:
        FailAtError: an argument is invalid.
    """

    def __init__(self, step, mode="raise", *, task=None, restart_count=None):
        super().__init__()
        if type(step) is not int or step < 1:
            raise FailAtError(
                f"Invalid value for argument `step`. Received: step={step!r}. Expected an integer >= 1."
            )
        if mode not in _MODES:
            raise FailAtError(
                f"Invalid value for argument `mode`. Received: mode={mode!r}. Expected one of {list(_MODES)}."
            )
        if task is not None and (len(task) != 2 or not isinstance(task[0], str) or type(task[1]) is not int):
            raise FailAtError(
                f"Invalid value for argument `task`. Received: task={task!r}. "
                "Expected None or (task_type, index)."
            )
        if restart_count is not None and (type(restart_count) is not int or restart_count < 0):
            raise FailAtError(
                f"Invalid value for argument `restart_count`. Received: restart_count={restart_count!r}. "
                "Expected None or an integer >= 0."
            )
        self.step, self.mode, self.task = step, mode, tuple(task) if task else None
        self.restart_count = restart_count
        self.fired = False
        self._before = 0

    def _here(self):
        if self.restart_count is not None:
            if _task_protocol.restart_count() != self.restart_count:
                return False
        if self.task is None:
            return True
        task = ClusterSpec.of_process(self.model.distribute_strategy)
        return (task.task_type or "worker", task.task_index or 0) == self.task

    def _global_step(self):
        return int(self.model.optimizer.iterations.numpy())

    def on_train_batch_begin(self, batch, logs=None):
        self._before = self._global_step()

    def on_train_batch_end(self, batch, logs=None):
        if self.fired or not self._before < self.step <= self._global_step() or not self._here():
            return
        self.fired = True
        sys.stdout.flush()
        sys.stderr.flush()
        if self.mode == "raise":
            raise InjectedFault(f"FailAt: injected fault after global step {self.step}")
        os.kill(os.getpid(), signal.SIGKILL if self.mode == "sigkill" else signal.SIGTERM)
