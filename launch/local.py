"""A real local cluster: N Python processes on loopback, one TF_CONFIG each.

Used by the tests (multi-worker runs with no mocked TensorFlow) and by users who
want to try multi-worker code on one machine:

    results = tfscale.launch.run_local_cluster(train, num_workers=2, args=(3,))
    [r.value for r in results]   # what `train(3)` returned in each worker
"""

import dataclasses
import importlib.util
import os
import pickle
import sys
import tempfile
import time

from tfscale._task_protocol import RESULT_VAR, TF_CONFIG_VAR
from tfscale.cluster import ClusterSpec
from tfscale.errors import FAILED_RUN, Error
from tfscale.launch import _procs
from tfscale.launch.supervisor import LaunchError

__all__ = ["ClusterRunError", "TaskResult", "run_local_cluster"]


class ClusterRunError(Error, RuntimeError):
    """A task of a local cluster failed or the cluster ran past its timeout (still a `RuntimeError`)."""

    exit_status = FAILED_RUN

    def __init__(self, message, results):
        super().__init__(message)
        self.results = results


@dataclasses.dataclass(frozen=True)
class TaskResult:
    """What one task of a local cluster did."""

    task_type: str
    index: int
    returncode: int
    value: object
    log: str

    @property
    def ok(self):
        return self.returncode == 0


def _cluster(ports, chief):
    addresses = [f"127.0.0.1:{p}" for p in ports]
    if chief:
        return ClusterSpec({"chief": addresses[:1], "worker": addresses[1:]})
    return ClusterSpec({"worker": addresses})


def _tasks(num_workers, chief):
    tasks = [("chief", 0)] if chief else []
    return tasks + [("worker", i) for i in range(num_workers)]


def _function_ref(fn):
    module = sys.modules[fn.__module__]
    path = getattr(module, "__file__", None)
    if path is None or "<locals>" in fn.__qualname__:
        raise LaunchError(
            f"Invalid value for argument `target`. Received: target={fn!r}. Expected a "
            "module-level function of an importable file, or a command list."
        )
    return {"path": os.path.abspath(path), "module": fn.__module__, "qualname": fn.__qualname__}


def run_local_cluster(
    target,
    num_workers=2,
    *,
    args=(),
    kwargs=None,
    chief=False,
    timeout=300.0,
    failure_grace=20.0,
    env=None,
    check=True,
    workdir=None,
):
    """Runs `target` in every task of a local multi-worker cluster.

    Args:
        target: a module-level function (called as `target(*args, **kwargs)` in
            each task; its return value comes back pickled) or a command list
            (`["python", "train.py"]`) run as it is.
        num_workers: how many "worker" tasks.
        args: positional arguments for a function target.
        kwargs: keyword arguments for a function target.
        chief: also start a "chief" task (index 0 of the results).
        timeout: seconds for the whole cluster; then every task is killed.
        failure_grace: once a task fails, seconds the others get to exit
            before they are killed (peers of a dead task usually hang).
        env: extra environment variables for every task.
        check: raise `ClusterRunError` unless every task exited 0.
        workdir: where task logs and results go (a temporary folder if None).

    Returns:
        A list of `TaskResult`, chief first, then workers by index.

    Raises:
        LaunchError: `num_workers` is not a positive integer, or a function `target` is not
            at module level of an importable file.
        ClusterRunError: a task failed or the timeout passed (with `check`).
    """
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise LaunchError(
            f"Invalid value for argument `num_workers`. Received: num_workers={num_workers!r}. "
            "Expected a positive integer."
        )
    tasks = _tasks(num_workers, chief)
    own_dir = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="tfscale-cluster-")
    cluster = _cluster(_procs.free_ports(len(tasks)), chief)
    if callable(target):
        spec_path = os.path.join(workdir, "target.pkl")
        with open(spec_path, "wb") as f:
            pickle.dump({"ref": _function_ref(target), "args": tuple(args), "kwargs": kwargs or {}}, f)
        argv = [sys.executable, "-m", "tfscale.launch._child", spec_path]
    else:
        argv = list(target)
    procs, logs = [], []
    try:
        for task_type, index in tasks:
            task_env = dict(os.environ, **(env or {}))
            task_env[TF_CONFIG_VAR] = cluster.to_json(task_type, index)
            task_env[RESULT_VAR] = os.path.join(workdir, f"{task_type}-{index}.result")
            log_path = os.path.join(workdir, f"{task_type}-{index}.log")
            with open(log_path, "wb") as log_file:
                procs.append(_procs.start(argv, env=task_env, log_file=log_file))
            logs.append(log_path)
        timed_out = _wait(procs, timeout, failure_grace)
    finally:
        _procs.stop(procs, grace_seconds=2.0)
    results = [_result(t, p, log, workdir) for t, p, log in zip(tasks, procs, logs)]
    if own_dir:
        _remove(workdir)
    if check and (timed_out or not all(r.ok for r in results)):
        raise ClusterRunError(_report(results, timed_out, timeout), results)
    return results


def _wait(procs, timeout, failure_grace):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            return False
        if any(c not in (None, 0) for c in codes):
            deadline = min(deadline, time.monotonic() + failure_grace)
        time.sleep(0.05)
    return any(p.poll() is None for p in procs)


def _result(task, proc, log_path, workdir):
    task_type, index = task
    with open(log_path, errors="replace") as f:
        log = f.read()
    value = None
    result_path = os.path.join(workdir, f"{task_type}-{index}.result")
    if os.path.exists(result_path):
        with open(result_path, "rb") as f:
            value = pickle.load(f)
    return TaskResult(task_type, index, proc.returncode, value, log)


def _report(results, timed_out, timeout):
    lines = [f"local cluster timed out after {timeout:.0f}s" if timed_out else "local cluster failed"]
    for r in results:
        lines.append(f"--- {r.task_type}:{r.index}: {_procs.describe_exit(r.returncode)}")
        lines.extend("    " + line for line in r.log.strip().splitlines()[-25:])
    return "\n".join(lines)


def _remove(path):
    for name in os.listdir(path):
        os.remove(os.path.join(path, name))
    os.rmdir(path)


def load_target(spec_path):
    """Loads the function a `run_local_cluster` task is to call (used by `_child`)."""
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    ref = spec["ref"]
    module = sys.modules.get(ref["module"])
    if module is None:
        module_spec = importlib.util.spec_from_file_location(ref["module"], ref["path"])
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[ref["module"]] = module
        sys.path.insert(0, os.path.dirname(ref["path"]))
        module_spec.loader.exec_module(module)
    fn = module
    for part in ref["qualname"].split("."):
        fn = getattr(fn, part)
    return fn, spec["args"], spec["kwargs"]
