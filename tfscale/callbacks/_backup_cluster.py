"""Checks across a cluster's workers for backups: every worker restored the same one.

Who writes the backup is `ClusterSpec.of_process(strategy).is_writer` (tfscale/cluster.py):
the chief, or worker 0 when the cluster has no chief, or the only process when there is no
cluster; other tasks never write to `backup_dir`.
"""

import tensorflow as tf

from tfscale.compat import tf_function_tracing

__all__ = ["all_agree", "from_writer"]


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
