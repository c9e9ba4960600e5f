"""What the launcher and a training task agree on, owned below both of them.

`tfscale.launch` (a capability) and `tfscale-train` (a binary) both need these facts;
keeping them here lets the launcher read them without importing the binary above it, and
the binary read them without importing the launcher: the `TFSCALE_*` variables the
launcher sets in each task, and the batch rule of elastic jobs (`--num_workers MIN:MAX`,
`--elastic_batch`): the launcher checks the command's global batch against every size the
range allows (`check_global_batch`); a task reads `TFSCALE_ELASTIC_WORKERS` /
`TFSCALE_ELASTIC_BATCH` and gets its global batch and learning rate from `elastic_batch`
(`tfscale-train` does, and so can a plain `model.fit` script; `tfscale.launch.elastic`
re-exports it).
"""

import dataclasses
import math
import os
import re

from tfscale.errors import LaunchError

__all__ = [
    "DEFAULT_GLOBAL_BATCH_SIZE",
    "ELASTIC_BATCH_MODES",
    "ELASTIC_BATCH_VAR",
    "ELASTIC_WORKERS_VAR",
    "JOB_ID_VAR",
    "RESTART_COUNT_VAR",
    "RESULT_VAR",
    "TF_CONFIG_VAR",
    "ElasticBatch",
    "WorkerRange",
    "check_global_batch",
    "elastic_batch",
    "parse_num_workers",
    "restart_count",
]

DEFAULT_GLOBAL_BATCH_SIZE = 64  # what `--global_batch_size` means when neither batch flag is given
# The launcher sets it in every task: 0 in the first attempt, n after n restarts (torchrun's
# TORCHELASTIC_RESTART_COUNT); unset when the task was not started by `tfscale-launch`.
RESTART_COUNT_VAR = "TFSCALE_RESTART_COUNT"
# The launcher sets it in every task: one id per job, the same across restarts (launch/jobs.py);
# BackupAndRestore keeps it in each backup and refuses another job's backup folder.
JOB_ID_VAR = "TFSCALE_JOB_ID"
# `run_local_cluster` sets it in each task it starts: the file where `tfscale.launch._child`
# pickles what the task's function returned.
RESULT_VAR = "TFSCALE_RESULT"
# TensorFlow's cluster description of a task (read by tfscale.cluster, written by the launcher).
TF_CONFIG_VAR = "TF_CONFIG"


def restart_count(environ=None):
    """This task's attempt: the launcher's `TFSCALE_RESTART_COUNT` (0 when unset)."""
    return int((os.environ if environ is None else environ).get(RESTART_COUNT_VAR, "0"))


ELASTIC_WORKERS_VAR = "TFSCALE_ELASTIC_WORKERS"
ELASTIC_BATCH_VAR = "TFSCALE_ELASTIC_BATCH"
ELASTIC_BATCH_MODES = ("global", "per_replica")


@dataclasses.dataclass(frozen=True)
class WorkerRange:
    """`--num_workers MIN:MAX`."""

    minimum: int
    maximum: int

    def __str__(self):
        return f"{self.minimum}:{self.maximum}"


def parse_num_workers(text):
    """`"4"` -> 4, `"2:4"` -> `WorkerRange(2, 4)`; raises `LaunchError` naming `--num_workers`."""
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(text))
    low, high = (int(match.group(1)), int(match.group(2) or match.group(1))) if match else (0, 0)
    if not match or low < 1 or high < low:
        raise LaunchError(
            f"Invalid value for `--num_workers`. Received: {text!r}. Expected a positive integer N or "
            "MIN:MAX with 1 <= MIN <= MAX."
        )
    return WorkerRange(low, high) if match.group(2) else low


def _flag_value(command, name):
    """The value of `--name=V` / `--name V` in the command's words, or None."""
    for i, word in enumerate(command):
        if word.startswith(f"--{name}="):
            return word.split("=", 1)[1]
        if word == f"--{name}" and i + 1 < len(command):
            return command[i + 1]
    return None


def _runs_tfscale_train(command):
    return any(os.path.basename(w) == "tfscale-train" or w == "tfscale.train" for w in command[:3])


def check_global_batch(command, worker_range, mode):
    """Fails unless the command's global batch splits as `mode` needs at every allowed size.

    `global`: the global batch must divide by the replicas of every size in the range;
    `per_replica`: by those of the full size (MAX). Reads `--global_batch_size` and
    `--cpu_replicas`/`--num_gpus` (tfscale-train's flags) from the command;
    `tfscale-train` without a batch flag uses its default. A command with no such flag
    is not checked (a plain script checks with `elastic_batch`).
    """
    per_replica_flag = _flag_value(command, "per_replica_batch_size")
    if mode == "global" and per_replica_flag is not None:
        raise LaunchError(
            "Invalid flags: `--elastic_batch=global` keeps the global batch, but the command fixes "
            "`--per_replica_batch_size`. Expected `--global_batch_size` in the command, or "
            "`--elastic_batch=per_replica`."
        )
    text = _flag_value(command, "global_batch_size")
    if text is None and per_replica_flag is None and _runs_tfscale_train(command):
        text = str(DEFAULT_GLOBAL_BATCH_SIZE)
    per_worker = _flag_value(command, "cpu_replicas") or _flag_value(command, "num_gpus") or "1"
    if text is None or not text.isdigit() or not per_worker.isdigit():
        return
    batch, per_worker = int(text), int(per_worker)
    sizes = (
        range(worker_range.minimum, worker_range.maximum + 1) if mode == "global" else [worker_range.maximum]
    )
    counts = [n * per_worker for n in sizes]
    bad = [c for c in counts if batch % c]
    if bad:
        allows = "a size `--num_workers" if mode == "global" else "the full size of `--num_workers"
        hint = (
            "(or `--elastic_batch=per_replica`)" if mode == "global" else "with `--elastic_batch=per_replica`"
        )
        raise LaunchError(
            f"Invalid flags: the command's `--global_batch_size={batch}` is not divisible by {bad[0]} "
            f"replicas, {allows} {worker_range}` allows. Expected a multiple of {math.lcm(*counts)} {hint}."
        )


@dataclasses.dataclass(frozen=True)
class ElasticBatch:
    """The global batch and learning rate a task of an elastic job trains with (see `elastic_batch`)."""

    mode: str
    worker_range: object
    num_replicas: int
    full_replicas: int
    global_batch_size: int
    learning_rate: float

    def describe(self):
        """One log line: the rule and the numbers it gave."""
        head = f"elastic ({self.worker_range} workers, --elastic_batch={self.mode}): {self.num_replicas}"
        if self.mode == "global":
            return (
                f"{head} replicas, global batch {self.global_batch_size} kept, "
                f"learning rate {self.learning_rate:g}"
            )
        per_replica = self.global_batch_size // self.num_replicas
        return (
            f"{head} of {self.full_replicas} replicas, per-replica batch {per_replica}, "
            f"global batch {self.global_batch_size}, learning rate {self.learning_rate:g} "
            f"(x {self.num_replicas}/{self.full_replicas})"
        )


def elastic_batch(
    global_batch_size, learning_rate, *, num_replicas, num_workers, per_replica_batch_size=None, environ=None
):
    """The batch and learning rate for this size of an elastic job (the launcher's variables).

    `--elastic_batch=global`: the global batch stays (so must divide by the replicas of
    every allowed size), and so does the learning rate: the same training as an
    uninterrupted run. `per_replica`: `global_batch_size` and `learning_rate` are those of
    the full size (MAX workers); at fewer replicas both shrink in proportion, so the
    per-replica batch stays and the rate follows the linear scaling rule (Goyal et al.).

    Args:
        global_batch_size: the global batch of the full-size job.
        learning_rate: the learning rate of the full-size job.
        num_replicas: replicas in sync now.
        num_workers: workers in the cluster now.
        per_replica_batch_size: with `per_replica`, the per-replica batch (instead of
            `global_batch_size`).
        environ: where to read `TFSCALE_ELASTIC_*` (default `os.environ`).

    Returns:
        An `ElasticBatch`, or None when the task is not part of an elastic job.

    Raises:
        LaunchError: a global batch that does not split as the rule needs.
    """
    environ = os.environ if environ is None else environ
    if ELASTIC_WORKERS_VAR not in environ:
        return None
    worker_range = parse_num_workers(environ[ELASTIC_WORKERS_VAR])
    if not isinstance(worker_range, WorkerRange):
        worker_range = WorkerRange(worker_range, worker_range)
    mode = environ.get(ELASTIC_BATCH_VAR, "global")
    full = worker_range.maximum * (num_replicas // max(num_workers, 1))
    if mode == "global":
        return ElasticBatch(mode, worker_range, num_replicas, full, global_batch_size, learning_rate)
    if per_replica_batch_size is not None:
        global_batch_size = per_replica_batch_size * full
    if global_batch_size % full:
        raise LaunchError(
            f"Invalid global batch for `--elastic_batch=per_replica`. Received: {global_batch_size} for "
            f"{full} replicas at the full size. Expected a multiple of {full}."
        )
    per_replica = global_batch_size // full
    scaled = learning_rate * num_replicas / full
    return ElasticBatch(mode, worker_range, num_replicas, full, per_replica * num_replicas, scaled)
