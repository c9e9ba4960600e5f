"""Who writes the backup in a cluster, and a check that every worker restored the same one."""

import dataclasses

import tensorflow as tf

from tfscale.cluster import ClusterSpec
from tfscale.compat import tf_function_tracing

__all__ = ["Role", "all_agree", "from_writer", "role"]


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


def role(strategy, environ=None):
    """The task of this process: the strategy's cluster, else `TF_CONFIG` in `environ`.

    `ClusterSpec.is_writer` decides who writes (the chief, or worker 0 when the cluster
    has no chief, or the only process when there is no cluster); other tasks never
    write to `backup_dir`. The environment counts for tasks whose strategy runs outside
    the cluster (an evaluator's), which must not write either.
    """
    spec = ClusterSpec.from_strategy(strategy)
    if spec.is_local:
        spec = ClusterSpec.from_env(environ, allow_unset=True)
    task_type, task_id = (spec.task_type, spec.task_index) if spec.task_type else ("worker", 0)
    return Role(task_type, task_id, spec.num_workers or 1, spec.is_writer)


def all_agree(strategy, value):
    """True when every replica of every worker passed the same integer (two all-reduces).

    Only meaningful under `MultiWorkerMirroredStrategy`, where each worker read the
    backup directory on its own; every worker must call it.
    """

    # In a tf.function: run/reduce called eagerly warn about their overhead once each.
    @tf.function
    def sum_across_workers(x):
        per_replica = strategy.run(tf.identity, args=(x,))
        return strategy.reduce("SUM", per_replica, axis=None)

    # Traced once per restore: TensorFlow's "frequent retracing" count would mistake
    # many short `fit`s in one process for retracing.
    tf_function_tracing.quiet_retracing(sum_across_workers)
    n = strategy.num_replicas_in_sync
    mean = float(sum_across_workers(tf.constant(float(value), tf.float64))) / n
    return float(sum_across_workers(tf.constant(float(value != mean), tf.float64))) == 0.0


def from_writer(strategy, writer):
    """A function `f(value)` that returns the writer's `value` (a float) on every worker.

    `writer` is True on the writing task only. Each call is one all-reduce of
    `[value * w, w]` (w = 1 on the writer, else 0), whose quotient is the writer's value
    whatever the number of replicas per worker; every worker must call it at the same
    point. Traced once, on the first call.
    """

    @tf.function
    def sum_across_workers(x):
        per_replica = strategy.run(tf.identity, args=(x,))
        return strategy.reduce("SUM", per_replica, axis=None)

    tf_function_tracing.quiet_retracing(sum_across_workers)
    w = 1.0 if writer else 0.0

    def call(value):
        total = sum_across_workers(tf.constant([float(value) * w, w], tf.float64)).numpy()
        return float(total[0] / total[1])

    return call
