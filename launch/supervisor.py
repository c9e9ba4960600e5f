"""The supervisor behind `tfscale-launch`: start a job's tasks, watch them, restart the job on failure.

Failure semantics follow torchrun's: the job is the unit. When any task exits
non-zero or dies by a signal, every other task is stopped (SIGTERM to its
process group, SIGKILL after `grace_period`), and the whole job starts again
after `restart_backoff` seconds, at most `max_restarts` times.

A task that never exits must not hang the launcher. Three rules, all checked
every 50 ms while a job attempt runs:

* `task_timeout`: an attempt running longer than this is stopped and fails.
* `finish_timeout`: once one task whose exit ends the job (chief and workers;
  the chief alone when there are parameter servers) has exited 0, the others
  must exit within this many seconds. Under collective training peers finish
  within a step of each other; one still running long after is stuck on a
  peer that is gone.
* `heartbeat_timeout`: a running task that wrote no output line for this
  many seconds is hung (a cut network link leaves collectives blocked with no
  error for minutes). Only useful for programs that print regularly.

A peer that *dies* needs no rule: its exit is seen at once and the rest are
stopped. Example:

    tasks = lambda attempt: [TaskSpec("worker:0", ("python", "-c", "pass"), os.environ)]
    result = launch(tasks, max_restarts=2)
    result.exit_code   # 0
"""

import contextlib
import dataclasses
import math
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Mapping, Optional, Tuple

from tfscale.errors import LaunchError
from tfscale.launch import _procs
from tfscale.launch._output import OutputPump

__all__ = ["Failure", "LaunchError", "LaunchResult", "Supervisor", "TaskSpec", "launch"]

_POLL_SECONDS = 0.05
# SIGHUP too: tasks run in their own sessions, so a closed terminal would not reach them.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_ROLES = ("completes", "server", "sidecar")


@dataclasses.dataclass(frozen=True)
class TaskSpec:
    """One process of a job attempt.

    Attributes:
        name: "worker:1"-style name, used as output prefix and in reports.
        argv: the command line.
        env: the complete environment of the process.
        role: "completes" (its exit 0 is needed for the job to succeed),
            "server" (runs until stopped, e.g. a parameter server) or
            "sidecar" (e.g. an evaluator: may fail the job, is stopped when
            the job completes).
    """

    name: str
    argv: Tuple[str, ...]
    env: Mapping[str, str]
    role: str = "completes"

    def __post_init__(self):
        if self.role not in _ROLES:
            raise LaunchError(
                f"Invalid value for argument `role`. Received: role={self.role!r}. Expected one of {_ROLES}."
            )


@dataclasses.dataclass(frozen=True)
class Failure:
    """Why one job attempt failed: which task, and what happened to it."""

    attempt: int
    task: str
    reason: str

    def __str__(self):
        return f"{self.task} failed ({self.reason}) in attempt {self.attempt}"


@dataclasses.dataclass(frozen=True)
class LaunchResult:
    """What a supervised job did: how many attempts, why they failed, how it ended."""

    succeeded: bool
    attempts: int
    failures: Tuple[Failure, ...]
    signal: Optional[int] = None

    @property
    def exit_code(self):
        """0 on success, 128+N when signal N stopped the launcher, else 1."""
        if self.succeeded:
            return 0
        return 128 + self.signal if self.signal else 1


class Supervisor:
    """Runs a job (a list of tasks per attempt) until it succeeds or runs out of restarts.

    Args:
        make_tasks: callable `attempt -> list of TaskSpec` (attempt counts from 1),
            so every attempt can get fresh ports.
        max_restarts: how many times the whole job may be restarted after a failure.
        restart_backoff: seconds between a failure and the restart.
        grace_period: seconds between SIGTERM and SIGKILL when stopping tasks.
        task_timeout: seconds one attempt may run (None: no limit).
        finish_timeout: seconds the other tasks get once a job-ending task exited 0.
        heartbeat_timeout: seconds a running task may stay silent (None: no limit).
        log_dir: per-task log files instead of prefixed lines on `sink`.
        sink: binary stream for task output (default: the launcher's stdout).
        say: callable for the launcher's own one-line messages (default: stderr).
        cwd: working directory of the tasks (default: the launcher's).
    """

    def __init__(
        self,
        make_tasks,
        *,
        max_restarts=0,
        restart_backoff=1.0,
        grace_period=10.0,
        task_timeout=None,
        finish_timeout=120.0,
        heartbeat_timeout=None,
        log_dir=None,
        sink=None,
        say=None,
        cwd=None,
    ):
        _check_number("max_restarts", max_restarts, integer=True)
        for name, value in [("restart_backoff", restart_backoff), ("grace_period", grace_period)]:
            _check_number(name, value)
        for name, value in [
            ("task_timeout", task_timeout),
            ("finish_timeout", finish_timeout),
            ("heartbeat_timeout", heartbeat_timeout),
        ]:
            if value is not None:
                _check_number(name, value, positive=True)
        self._make_tasks = make_tasks
        self._max_restarts = max_restarts
        self._backoff = restart_backoff
        self._grace = grace_period
        self._task_timeout = task_timeout
        self._finish_timeout = finish_timeout
        self._heartbeat = heartbeat_timeout
        self._log_dir = log_dir
        self._sink = sink if sink is not None else sys.stdout.buffer
        self._say = say or _say_stderr
        self._cwd = cwd
        self._signal = None

    def run(self):
        """Runs the job; returns a `LaunchResult`. SIGINT, SIGTERM, SIGHUP are forwarded to the tasks."""
        created = self._make_log_dir()
        previous = self._install_signal_handlers()
        try:
            return self._run_attempts()
        except LaunchError:
            for folder in created:  # a log that could not be written: leave nothing behind
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # only while empty
            raise
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _make_log_dir(self):
        """Creates `log_dir`; returns the folders it created, deepest first."""
        if self._log_dir is None:
            return []
        created = []
        folder = os.path.abspath(self._log_dir)
        try:
            while not os.path.isdir(folder) and folder not in created:
                created.append(folder)
                folder = os.path.dirname(folder)
            os.makedirs(self._log_dir, exist_ok=True)
        except OSError as e:
            raise _log_dir_error(self._log_dir, self._log_dir, e) from None
        return created

    def _run_attempts(self):
        failures = []
        total = self._max_restarts + 1
        for attempt in range(1, total + 1):
            failure = self._run_attempt(attempt, total)
            if self._signal:
                name = signal.Signals(self._signal).name
                self._say(f"stopped by {name}: forwarded it to every task (attempt {attempt} of {total})")
                return LaunchResult(False, attempt, tuple(failures), self._signal)
            if failure is None:
                if attempt > 1:
                    self._say(f"job succeeded in attempt {attempt} of {total}")
                return LaunchResult(True, attempt, tuple(failures))
            failures.append(failure)
            if attempt == total:
                self._say(
                    f"job failed: {failure}; no restarts left (--max_restarts={self._max_restarts}, "
                    f"{attempt} attempt{'s' if attempt > 1 else ''} made)"
                )
                break
            self._say(
                f"{failure}; restarting the job (restart {attempt} of {self._max_restarts}) "
                f"in {self._backoff:g}s"
            )
            self._sleep(self._backoff)
            if self._signal:
                return LaunchResult(False, attempt, tuple(failures), self._signal)
        return LaunchResult(False, total, tuple(failures))

    def _run_attempt(self, attempt, total):
        tasks = list(self._make_tasks(attempt))
        pump = OutputPump(self._sink, self._log_dir)
        procs = {}
        header = f"--- tfscale-launch: attempt {attempt} of {total} ({time.strftime('%Y-%m-%d %H:%M:%S')})"
        try:
            # Every log is opened and its header written before any task starts: a log that
            # cannot be written is one line now, not a dead reader thread and a blocked task later.
            pump.open_logs([t.name for t in tasks], header)
        except OSError as e:
            raise _log_dir_error(self._log_dir, e.filename, e) from None
        self._say(
            f"attempt {attempt} of {total}: starting {len(tasks)} task{'s' if len(tasks) > 1 else ''}: "
            f"{' '.join(t.name for t in tasks)}"
        )
        failure = None
        try:
            for task in tasks:
                procs[task.name] = self._start(task)
                pump.follow(task.name, procs[task.name].stdout)
            failure = self._watch(attempt, tasks, procs, pump)
        finally:
            running = list(procs.values())
            if self._signal:
                _procs.stop_with_signal(running, self._signal, self._grace, hurry=self._hurry)
            else:
                _procs.stop(running, self._grace, hurry=self._hurry)
            pump.join()
        return failure

    def _start(self, task):
        try:
            return _procs.start(list(task.argv), env=dict(task.env), log_file=subprocess.PIPE, cwd=self._cwd)
        except OSError as e:
            raise LaunchError(
                f"cannot start the command of {task.name}: `{task.argv[0]}`: {e.strerror}"
            ) from None

    def _watch(self, attempt, tasks, procs, pump):
        started = time.monotonic()
        first_done = None  # (name, time) of the first job-ending task that exited 0.
        while not self._signal:
            now = time.monotonic()
            running = []
            for task in tasks:
                code = procs[task.name].poll()
                if code is None:
                    running.append(task)
                elif code != 0:
                    return Failure(attempt, task.name, _procs.describe_exit(code))
                elif task.role == "completes" and first_done is None:
                    first_done = (task.name, now)
            waiting = [t for t in running if t.role == "completes"]
            if not waiting:
                return None
            failure = self._hang_rule(attempt, now - started, first_done, waiting, running, pump)
            if failure is not None:
                return failure
            time.sleep(_POLL_SECONDS)
        return None

    def _hang_rule(self, attempt, elapsed, first_done, waiting, running, pump):  # noqa: PLR0917
        if (
            first_done is not None
            and self._finish_timeout is not None
            and time.monotonic() - first_done[1] > self._finish_timeout
        ):
            reason = (
                f"still running {self._finish_timeout:g}s after {first_done[0]} exited 0 (--finish_timeout)"
            )
            return Failure(attempt, waiting[0].name, reason)
        if self._task_timeout is not None and elapsed > self._task_timeout:
            return Failure(
                attempt, waiting[0].name, f"still running after {self._task_timeout:g}s (--task_timeout)"
            )
        if self._heartbeat is not None:
            for task in running:
                if pump.silent_for(task.name) > self._heartbeat:
                    reason = f"printed nothing for {self._heartbeat:g}s (--heartbeat_timeout)"
                    return Failure(attempt, task.name, reason)
        return None

    def _hurry(self):
        """Seconds a stop in progress is cut to now (a subclass's longer grace), or None."""
        return None

    def _sleep(self, seconds):
        deadline = time.monotonic() + seconds
        while not self._signal and time.monotonic() < deadline:
            time.sleep(min(_POLL_SECONDS, max(0.0, deadline - time.monotonic())))

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return {}

        def _forward(signum, frame):
            del frame
            self._signal = self._signal or signum

        return {sig: signal.signal(sig, _forward) for sig in _FORWARDED}


def launch(make_tasks, **options):
    """Runs a supervised job; `Supervisor(make_tasks, **options).run()`.

    Returns:
        A `LaunchResult`; its `exit_code` is what `tfscale-launch` exits with.

    Raises:
        LaunchError: bad options, or a task's command cannot be started.
    """
    return Supervisor(make_tasks, **options).run()


def _log_dir_error(log_dir, path, error):
    return LaunchError(
        f"Cannot write the task logs of `--log_dir`={log_dir!r}: {path!r}: {error.strerror or error}. "
        "Expected a writable folder with free space."
    )


def _check_number(name, value, integer=False, positive=False):
    kind = int if integer else (int, float)
    bad = isinstance(value, bool) or not isinstance(value, kind)
    # nan passes every comparison test below (all are false): a nan timeout would mean none.
    bad = bad or not math.isfinite(value) or value < 0 or (positive and value == 0)
    if bad:
        expected = "a positive number" if positive else ("an integer >= 0" if integer else "a number >= 0")
        raise LaunchError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected}."
        )


def _say_stderr(message):
    print(f"tfscale-launch: {message}", file=sys.stderr, flush=True)
