"""Who writes the backup in a cluster, and a check that every worker restored the same one."""

import dataclasses
import json
import os

import tensorflow as tf

__all__ = ["Role", "all_agree", "role"]


@dataclasses.dataclass(frozen=True)
class Role:
    """This process's place in the job, as far as backups care."""

    task_type: str
    task_id: int
    num_workers: int
    writer: bool

    @property
    def label(self):
        return f"{self.task_type}:{self.task_id}"


def _cluster(strategy, environ):
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is not None:
        spec = resolver.cluster_spec().as_dict()
        if spec:
            return spec, resolver.task_type, int(resolver.task_id or 0)
    try:
        tf_config = json.loads(environ.get("TF_CONFIG") or "{}")
    except ValueError:
        tf_config = {}
    task = tf_config.get("task") or {}
    return tf_config.get("cluster") or {}, task.get("type", "worker"), int(task.get("index", 0))


def role(strategy, environ=None):
    """The task of this process (from the strategy's cluster resolver, else `TF_CONFIG`).

    The writer is the chief, or worker 0 when the cluster has no chief, or the only
    process when there is no cluster. Other tasks never write to `backup_dir`.
    """
    cluster, task_type, task_id = _cluster(strategy, os.environ if environ is None else environ)
    num_workers = sum(len(cluster.get(t, ())) for t in ("chief", "worker")) or 1
    if num_workers == 1:
        writer = True
    elif cluster.get("chief"):
        writer = task_type == "chief"
    else:
        writer = task_type == "worker" and task_id == 0
    return Role(task_type, task_id, num_workers, writer)


def _sum_across_workers(strategy, value):
    local = tf.constant(value, tf.float64)
    per_replica = strategy.run(lambda: tf.identity(local))
    return float(strategy.reduce("SUM", per_replica, axis=None).numpy())


def all_agree(strategy, value):
    """True when every replica of every worker passed the same integer (two all-reduces).

    Only meaningful under `MultiWorkerMirroredStrategy`, where each worker read the
    backup directory on its own; every worker must call it.
    """
    n = strategy.num_replicas_in_sync
    mean = _sum_across_workers(strategy, float(value)) / n
    return _sum_across_workers(strategy, float(value != mean)) == 0.0
