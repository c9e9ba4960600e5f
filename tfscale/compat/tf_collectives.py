"""The cross-worker collectives of a `MultiWorkerMirroredStrategy`, used outside its `run`.

`tfscale.horovod` gives each process its own model and its own `fit` (Horovod's model:
one rank, no strategy scope) and exchanges tensors only through explicit calls. Those
calls run on the same collective ops `multi_worker` all-reduces gradients with: the
strategy's `CollectiveAllReduce` (a public `tf.distribute.CrossDeviceOps`), reached
through the private attribute `extended._cross_device_ops` (TF 2.4 through 2.21; the
same attribute `keras_optimizer` launches gradients on). Its public `reduce` and
`batch_reduce` need no strategy context, so they work eagerly, inside a `tf.function`
and inside Keras's default-strategy train step. All-gather has no public entry on
`CrossDeviceOps`: `_gather` (TF 2.4 through 2.21) gathers along axis 0 and pads when the
workers' first dimensions differ.

Gate: `supported(strategy)` is False when the attribute or `_gather` is gone; then
`tfscale.horovod.init` fails with one line instead of training wrongly.
"""

import tensorflow as tf

__all__ = ["Collectives", "supported"]


def supported(strategy):
    """Whether `strategy` exposes the collective ops this module uses."""
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return isinstance(ops, tf.distribute.CrossDeviceOps) and hasattr(ops, "_gather")


class Collectives:
    """All-reduce and all-gather of plain tensors across the workers of `strategy` (one device each)."""

    def __init__(self, strategy):
        self._ops = strategy.extended._cross_device_ops
        self._device = strategy.extended.worker_devices[0]
        self.bytes_launched = 0  # handed to the collective ops eagerly (what travels, per rank)

    @staticmethod
    def _local(value):
        return value.values[0] if isinstance(value, tf.distribute.DistributedValues) else value

    def all_reduce_sum(self, tensors):
        """The element-wise sums over workers of `tensors` (a list), in one batched launch."""
        if tf.executing_eagerly():
            self.bytes_launched += sum(t.dtype.size * int(tf.size(t)) for t in tensors)
        # On this worker's device, so `batch_reduce` sees values and destinations match and
        # packs them into one launch (else it warns and launches one per tensor).
        with tf.device(self._device):
            pairs = [(tf.identity(t), self._device) for t in tensors]
        return [self._local(r) for r in self._ops.batch_reduce(tf.distribute.ReduceOp.SUM, pairs)]

    def all_gather(self, tensor):
        """`tensor` of every worker, concatenated along axis 0 in worker order."""
        return self._local(self._ops._gather(tensor, self._device, axis=0))
