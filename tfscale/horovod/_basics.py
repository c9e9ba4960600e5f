"""`init`, `shutdown` and who this process is: rank, size, local and cross ranks.

Identity comes from `tfscale.cluster.ClusterSpec` (the one reader of `TF_CONFIG`), as
`tfscale-launch` sets it: rank = the task's place among the chief and workers (chief
first, as TensorFlow numbers them), size = their number. Local ranks count the tasks on
the same host (the host part of their addresses); cross ranks number the hosts in the
order they first appear. With no `TF_CONFIG` the process is rank 0 of 1.
"""

import dataclasses
import os

from tfscale.cluster import ClusterSpec
from tfscale.horovod._errors import HorovodError

__all__ = [
    "cross_rank",
    "cross_size",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]

_START_TIMEOUT_VARIABLE = "HOROVOD_START_TIMEOUT"  # Horovod's own spelling of the peer wait
# Horovod variables whose effect a user would miss without a word (a file, a tuning run).
_UNSUPPORTED_VARIABLES = {
    "HOROVOD_TIMELINE": "tfscale.callbacks.CommunicationProfiler (a Chrome trace of the all-reduces)",
    "HOROVOD_TIMELINE_MARK_CYCLES": "tfscale.callbacks.CommunicationProfiler",
    "HOROVOD_AUTOTUNE": "no equivalent (tfscale all-reduces each group in one launch)",
}


@dataclasses.dataclass(frozen=True)
class _Identity:
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int
    cross_size: int


def identity_of(spec):
    """The Horovod numbers of the task of `spec` (a `ClusterSpec`)."""
    if spec.is_local:
        return _Identity(0, 1, 0, 1, 0, 1)
    if spec.worker_index is None:
        raise HorovodError(
            f"Task {spec.task_label} has no Horovod rank. Expected a chief or worker task "
            "(tfscale-launch -np N starts N workers)."
        )
    ranked = [a for t, _, a in spec.tasks() if t in ("chief", "worker")]
    hosts = [a.rpartition(":")[0] for a in ranked]
    mine = hosts[spec.worker_index]
    distinct = list(dict.fromkeys(hosts))
    return _Identity(
        rank=spec.worker_index,
        size=len(ranked),
        local_rank=hosts[: spec.worker_index].count(mine),
        local_size=hosts.count(mine),
        cross_rank=distinct.index(mine),
        cross_size=len(distinct),
    )


class _State:
    identity = None  # set by init()
    collectives = None  # tfscale.compat.tf_collectives.Collectives, when size > 1
    strategy = None  # kept across shutdown/init: TensorFlow's collective context lives on


def _start_timeout(cluster_timeout, environ):
    if cluster_timeout is not None:
        return cluster_timeout
    text = environ.get(_START_TIMEOUT_VARIABLE)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise HorovodError(
            f"Invalid value for `{_START_TIMEOUT_VARIABLE}`. Received: {text!r}. Expected seconds."
        ) from None


def _check_environment(environ):
    for name, equivalent in _UNSUPPORTED_VARIABLES.items():
        if environ.get(name):
            raise HorovodError(f"`{name}` is not supported by tfscale.horovod. Use {equivalent} instead.")


def init(comm=None, process_sets=None, *, cluster_timeout=None):
    """Joins this process to the job: reads the cluster and connects to the other ranks.

    Args:
        comm: Horovod's MPI communicator; only None (tfscale is not MPI based).
        process_sets: only None (tfscale has one set: every rank).
        cluster_timeout: seconds to wait for the other ranks to start before failing
            with a line naming the missing ones. Default: `HOROVOD_START_TIMEOUT`, else
            300 s (as `multi_worker`).

    Raises:
        HorovodError: an unsupported argument or Horovod variable, a task with no rank.
        StartTimeoutError: the other ranks did not all start in time (names them).
    """
    if comm is not None or process_sets is not None:
        given = "comm" if comm is not None else "process_sets"
        raise HorovodError(
            f"Invalid value for argument `{given}`: tfscale.horovod has no MPI communicator or process "
            "sets. Expected None (every rank of the job)."
        )
    _check_environment(os.environ)
    spec = ClusterSpec.from_env(allow_unset=True)
    identity = identity_of(spec)
    if identity.size > 1 and _State.strategy is None:
        timeout = _start_timeout(cluster_timeout, os.environ)
        _pin_local_gpu(identity)
        try:
            _State.strategy, _State.collectives = _connect(spec, timeout)
        except RuntimeError as e:  # TensorFlow: "Collective ops must be configured at program startup"
            raise HorovodError(
                f"hvd.init() ran after TensorFlow started ({e}). Expected hvd.init() before any TensorFlow "
                "op or model: TensorFlow configures its cross-process collectives at startup."
            ) from None
    _State.identity = identity


def _pin_local_gpu(identity):
    """Each rank on GPU `local_rank` (as Horovod scripts pin themselves), before TensorFlow starts.

    The multi-worker collectives are configured at startup, after which the visible devices
    cannot change; a rank that saw every GPU of its host would also replicate over all of
    them. Not exercised on GPUs in this repository's tests (CPU only).
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus and identity.local_size <= len(gpus):
        tf.config.set_visible_devices(gpus[identity.local_rank], "GPU")


def _connect(spec, cluster_timeout):
    from tfscale import strategies
    from tfscale.compat import tf_collectives

    timeout = strategies.DEFAULT_CLUSTER_TIMEOUT if cluster_timeout is None else cluster_timeout
    try:
        strategy = strategies.get("multi_worker", cluster=spec, cluster_timeout=timeout)
    except strategies.ClusterTimeoutError as e:
        raise _start_timeout_error(spec, timeout, e.missing) from None
    if not tf_collectives.supported(strategy):
        raise HorovodError(
            "This TensorFlow's MultiWorkerMirroredStrategy has no `_cross_device_ops`/`_gather`. "
            "Expected TensorFlow 2.4 to 2.21 (see tfscale/compat/tf_collectives.py)."
        )
    return strategy, tf_collectives.Collectives(strategy)


class StartTimeoutError(HorovodError):
    """Other ranks did not start within the start timeout (a failed run, exit 1)."""

    exit_status = 1


def _start_timeout_error(spec, timeout, missing):
    ranks = [
        f"rank {spec.with_task(t, int(i)).worker_index} ({t}:{i} at {spec.task_address(t, int(i))})"
        for t, i in missing
    ]
    return StartTimeoutError(
        f"hvd.init on rank {spec.worker_index} waited {timeout:g} s for {', '.join(ranks)}, which never "
        f"started. Expected every rank of the job running (raise {_START_TIMEOUT_VARIABLE} for slow starts)."
    )


def shutdown():
    """Marks Horovod as not initialized (TensorFlow keeps its connections for a later `init`)."""
    _State.identity = None


def is_initialized():
    """True between `init()` and `shutdown()`."""
    return _State.identity is not None


def current():
    """This process's identity, or `HorovodError` before `init()`."""
    if _State.identity is None:
        raise HorovodError("Horovod has not been initialized. Expected `hvd.init()` before this call.")
    return _State.identity


def rank():
    """This process's rank: 0 .. size() - 1."""
    return current().rank


def size():
    """The number of ranks of the job."""
    return current().size


def local_rank():
    """This process's rank among the ranks on its host."""
    return current().local_rank


def local_size():
    """The number of ranks on this process's host."""
    return current().local_size


def cross_rank():
    """The index of this process's host among the job's hosts."""
    return current().cross_rank


def cross_size():
    """The number of hosts of the job."""
    return current().cross_size
