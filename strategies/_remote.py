"""Devices on other tasks of a cluster: one client drives them, the other tasks serve them.

The pipeline and model split place each part with `tf.device`; TensorFlow's distributed
runtime (gRPC send/recv between tasks) runs a part placed on another task's device there.
So a cluster is used the way `tf.distribute.experimental.ParameterServerStrategy` uses
one: the chief (worker 0 when there is no chief) is the *client*, connects to the cluster
(`tf.config.experimental_connect_to_cluster`) and runs the training; every other task runs
a `tf.distribute.Server` that serves its devices until the client has gone. Nothing is
written on the wire by hand.

Every wait is bounded: the client waits at most `cluster_timeout` for the other tasks'
ports (else a `ClusterTimeoutError` naming them: TensorFlow's connect to a port nobody
listens on blocks in C++ with no output), and a serving task waits as long for the client.
"""

import time

import tensorflow as tf

from tfscale.compat.tf_sigterm import SigtermDefault
from tfscale.strategies import _devices
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._peers import (
    DEFAULT_CLUSTER_TIMEOUT,
    ClusterTimeoutError,
    _reachable,
    check_cluster_timeout,
)

__all__ = ["connect_cluster"]

_RETRY_SECONDS = 0.2
_POLL_SECONDS = 0.5
# A client counts as gone after this many failed probes in a row (one refused connection
# can be a full accept queue on a loaded machine).
_GONE_AFTER = 3


def connect_cluster(cluster, *, cluster_timeout=DEFAULT_CLUSTER_TIMEOUT):
    """Makes every task's devices usable from the client; returns whether this task is it.

    On the chief (worker 0 if the cluster has no chief): waits for the other tasks, connects
    to the cluster and returns True; `strategies.get("pipeline", ...)` then places stages on
    any task's device ('/job:worker/replica:0/task:1/device:CPU:0'), and by default on the
    cluster's devices task by task. On every other task: serves this task's devices
    (all of its logical CPU devices, e.g. after `split_cpu(2)`, and its GPUs) until the
    client has gone, then returns False; the caller exits.

    Call it before any TensorFlow op (the runtime starts here), after `split_cpu`.

    Args:
        cluster: the `tfscale.cluster.ClusterSpec` of this process, with its task set.
        cluster_timeout: seconds to wait for the other tasks (on the client) or for the
            client (on a serving task).

    Returns:
        True on the client, False on a serving task once the client has gone.

    Raises:
        StrategyError: `cluster` has no task or only one task.
        ClusterTimeoutError: a task was not reachable within `cluster_timeout`; names it.
    """
    cluster_timeout = check_cluster_timeout(cluster_timeout)
    if cluster.task_type is None or cluster.task_count < 2:
        raise StrategyError(
            f"Invalid value for argument `cluster`. Received: a cluster of {cluster.task_count} "
            f"task(s), this process {cluster.task_label}. Expected several tasks and this "
            "process's task (TF_CONFIG's `task`)."
        )
    spec = cluster.to_resolver().cluster_spec()
    if cluster.is_chief:
        others = [(f"{t}:{i}", a) for t, i, a in cluster.tasks() if (t, i) != _me(cluster)]
        _wait(cluster, others, cluster_timeout, "never became reachable")
        with SigtermDefault():
            tf.config.experimental_connect_to_cluster(
                spec, job_name=cluster.task_type, task_index=cluster.task_index
            )
        names = [d.name for d in tf.config.list_logical_devices()]
        _devices.use_cluster((cluster.task_type, 0, cluster.task_index), names)
        return True
    _serve(cluster, spec, cluster_timeout)
    return False


def _me(cluster):
    return cluster.task_type, cluster.task_index


def _client(cluster):
    if "chief" in cluster.cluster:
        return "chief:0", cluster.task_address("chief", 0)
    return "worker:0", cluster.task_address("worker", 0)


def _wait(cluster, tasks, cluster_timeout, verb):
    deadline = time.monotonic() + cluster_timeout
    while True:
        tasks = [(label, a) for label, a in tasks if not _reachable(a)]
        if not tasks:
            return
        if time.monotonic() >= deadline:
            raise ClusterTimeoutError(
                f"Task {cluster.task_label} waited cluster_timeout={cluster_timeout:g} s: "
                f"{', '.join(f'{label} ({a})' for label, a in tasks)} {verb}. Expected every "
                "task of the cluster running (raise cluster_timeout for slow starts)."
            )
        time.sleep(_RETRY_SECONDS)


def _serve(cluster, spec, cluster_timeout):
    """Serves this task's devices from `tf.distribute.Server` until the client has gone."""
    # A server takes its devices from its ConfigProto, not from the process's logical
    # device configuration: pass the split on, or a `split_cpu(2)` task serves one CPU.
    config = tf.compat.v1.ConfigProto(device_count={"CPU": len(_devices.local_device_names("CPU"))})
    with SigtermDefault():
        server = tf.distribute.Server(
            spec, job_name=cluster.task_type, task_index=cluster.task_index, protocol="grpc", config=config
        )
    client = _client(cluster)
    _wait(cluster, [client], cluster_timeout, "(the client) never connected")
    missed = 0
    while missed < _GONE_AFTER:
        time.sleep(_POLL_SECONDS)
        missed = 0 if _reachable(client[1]) else missed + 1
    del server  # TensorFlow stops a server only at exit; the caller exits next.
