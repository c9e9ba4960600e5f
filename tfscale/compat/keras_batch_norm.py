"""Keras 3 BatchNormalization under `MirroredStrategy` / `MultiWorkerMirroredStrategy`: the global batch.

Checked on Keras 3.15.1 with TensorFlow 2.21.0 only.
In training, `BatchNormalization.call` normalises by `self._moments(inputs, mask)`
(keras/src/layers/normalization/batch_normalization.py). Under a strategy each replica
takes the mean and variance of its own slice of the global batch unless the layer was
built with `synchronized=True` (Keras's documented default; keras-team/keras#18667 and
#18671 added `synchronized` for TensorFlow, off by default). A data-parallel run of a model
with a trainable BatchNormalization then differs from one device: the outputs, so the loss
and the gradients, and the moving mean and variance, which each replica moves from its own
moments in its own copy (Keras makes them with aggregation NONE), so replica 0's copy, the
one read and saved, saw only its slice. Measured on tests/test_equivalence.py's batchnorm
models (Dense(8, no bias), BatchNormalization, then Dense; 16 samples in batches of 8, 2
epochs, `mirrored` on 2 CPUs): its 7 such cases gave per-epoch losses 0.02 to 0.14 off one
device's; with this fix all 7 are equal to 2.8e-7 (float32; 2e-5 under mixed_float16).

`synchronized=True` is not the fix: it changes the user's model (its config and saved file
say so), computes the variance as E[x^2] - E[x]^2 (cancellation; one device's
`tf.nn.moments` subtracts the mean first), and a masked input (`_moments`' other branch)
is not synchronised at all.

`apply()` (where `needed()` and the gate hold) wraps `BatchNormalization._moments` at the
class, so every BatchNormalization of the process (nested in sub-models or custom layers,
built before or inside `strategy.scope()`, before or after `apply()`) computes, in the
replica context of a traced Mirrored/MWMS step with 2 or more replicas, the moments of
the global batch the way one device computes them:

- no mask: `tf.nn.moments`' two passes, the sum and the element count SUM-all-reduced
  (one launch), the mean; then the squared differences from that mean (a stop-gradient,
  as there) summed and all-reduced (a second launch), the variance;
- a mask: Keras's masked branch, its masked sum and weight count all-reduced, then its
  squared distances; divided by the global count plus Keras's epsilon, as there.

Each all-reduce is the strategy's own collective launched from replica context
(`keras_optimizer.all_reduce_exact`, as the loss fix's: no `merge_call`, no compression),
and differentiates as TensorFlow's `ReplicaContext.all_reduce` does (its gradient is the
all-reduce of the incoming gradients): each replica's gradient carries its share of every
replica's loss through the shared moments, and the summed gradients are one device's.
Every replica has the same moments, so their copies of the moving averages move alike, to
one device's values. The loss denominators are the loss fix's (`keras_loss_denominator`).

Unchanged: layers built with `synchronized=True` (Keras's own path), inference
(`training=False`, `trainable=False`, which Keras runs in inference mode; `evaluate` and
`predict` use the moving statistics), one replica, eager replicas (`run_eagerly=True`:
Keras's per-replica moments, as the loss fix leaves its means), every other strategy, and
the model: `synchronized` stays what the user wrote, in `get_config()` and in saved files.
A strategy marked by `keep_replica_statistics(strategy)` (what
`tfscale.strategies.get("mirrored" | "multi_worker", replica_statistics=True)` does; call it
on a strategy you build yourself) keeps Keras's per-replica statistics.
Cost: two small launches per trainable BatchNormalization per training step (C + 1 and C
numbers for C channels), and two more in the backward pass.

Gate: this fix's own `_FIXED_IN` (None: Keras keeps per-replica statistics by design), and
`BatchNormalization._moments(self, inputs, mask)` present; otherwise nothing is changed.
Test: tests/test_compat_keras_batch_norm.py.
`tfscale.strategies.get("mirrored" | "multi_worker")` applies it (`apply_strategy_fixes`);
users who build those strategies by hand call `tfscale.compat.apply_strategy_fixes()` once.
"""

import functools
import inspect

import keras
import tensorflow as tf

from tfscale.compat import keras_optimizer
from tfscale.compat.keras_multi_worker import _version_tuple

__all__ = ["CHECKED_ON", "NAME_SCOPE", "apply", "is_applied", "keep_replica_statistics", "needed"]

CHECKED_ON = ("3.15.1", "2.21.0")
# The name scope of this fix's all-reduce ops (told apart from the gradients' launches by
# `strategies._communication.traced_all_reduces`).
NAME_SCOPE = "tfscale_batch_norm"
# First Keras release whose BatchNormalization takes the global batch's statistics under a
# strategy by default; None: not planned upstream (per-replica is Keras's documented default).
_FIXED_IN = None
_KEEP = "_tfscale_replica_statistics"  # on a strategy: keep Keras's per-replica statistics
_state = {"applied": False, "original": None}


def needed(version=None):
    """True when this Keras version normalises each replica's slice by its own statistics."""
    version = _version_tuple(version or keras.__version__)
    if version < (3,):
        return False
    return _FIXED_IN is None or version < _version_tuple(_FIXED_IN)


def is_applied():
    """True once `apply()` has patched this process's BatchNormalization."""
    return _state["applied"]


def keep_replica_statistics(strategy, keep=True):
    """Marks `strategy` to keep (or not) Keras's per-replica BatchNormalization statistics."""
    setattr(strategy, _KEEP, bool(keep))


def _layer_class():
    from keras.src.layers.normalization import batch_normalization

    return batch_normalization.BatchNormalization


def _gate():
    moments = getattr(_layer_class(), "_moments", None)
    return callable(moments) and list(inspect.signature(moments).parameters) == ["self", "inputs", "mask"]


def _active():
    """In the replica context of a traced Mirrored/MWMS step with 2+ replicas, not kept per replica."""
    if not keras_optimizer._active():
        return False
    strategy = tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync > 1 and not getattr(strategy, _KEEP, False)


@tf.custom_gradient
def _sum_over_replicas(value):
    """The SUM of `value` over every replica; its gradient is the SUM of the incoming ones."""
    with tf.name_scope(NAME_SCOPE):
        total = keras_optimizer.all_reduce_exact([value])[0]

    def grad(upstream, variables=None):
        with tf.name_scope(NAME_SCOPE):
            reduced = keras_optimizer.all_reduce_exact([upstream])[0]
        return (reduced, [None] * len(variables)) if variables else reduced

    return total, grad


def _summed(*parts):
    """Each of `parts` summed over the replicas, in one launch (flattened, then split again)."""
    flat = tf.concat([tf.reshape(p, [-1]) for p in parts], 0)
    total = _sum_over_replicas(flat)
    # Static sizes where known (always, for a layer with a known channel count): the moments
    # keep their static shapes.
    static = all(p.shape.is_fully_defined() for p in parts)
    sizes = [p.shape.num_elements() for p in parts] if static else tf.stack([tf.size(p) for p in parts])
    return [tf.reshape(t, p.shape if static else tf.shape(p)) for t, p in zip(tf.split(total, sizes), parts)]


def _moments_unmasked(x, axes):
    """`tf.nn.moments(x, axes)` (what Keras's `ops.moments` runs) over the global batch."""
    count = tf.stop_gradient(tf.cast(tf.reduce_prod(tf.gather(tf.shape(x), axes)), x.dtype))
    total, count = _summed(tf.reduce_sum(x, axes, keepdims=True), count)
    mean = total / count
    squares = tf.reduce_sum(tf.math.squared_difference(x, tf.stop_gradient(mean)), axes, keepdims=True)
    (squares,) = _summed(squares)
    return tf.squeeze(mean, axes), tf.squeeze(squares / count, axes)


def _moments_masked(inputs, mask, axes):
    """Keras's masked branch of `BatchNormalization._moments` over the global batch."""
    ops = keras.ops
    mask = ops.cast(ops.broadcast_to(ops.expand_dims(mask, axis=-1), ops.shape(inputs)), "bool")
    weights = tf.stop_gradient(ops.sum(ops.cast(mask, inputs.dtype), axes, keepdims=True))
    total, weights = _summed(ops.sum(ops.where(mask, inputs, 0), axes, keepdims=True), weights)
    mean = total / (weights + keras.config.epsilon())
    (squares,) = _summed(ops.sum(ops.square(ops.where(mask, inputs - mean, 0)), axes, keepdims=True))
    return ops.squeeze(mean), ops.squeeze(squares / (weights + keras.config.epsilon()))


def _make_moments(original):
    @functools.wraps(original)
    def _moments(self, inputs, mask):
        if self.synchronized or not _active():
            return original(self, inputs, mask)
        with tf.name_scope(NAME_SCOPE):
            if mask is None:
                return _moments_unmasked(inputs, self._reduction_axes)
            return _moments_masked(inputs, mask, self._reduction_axes)

    _moments._tfscale_global_batch = True
    return _moments


def apply():
    """Makes a trainable BatchNormalization under data parallelism normalise as on one device.

    Idempotent. Does nothing where upstream changed this or the patched method is gone.

    Returns:
        True if the fix is in effect after the call, False if not.
    """
    if _state["applied"]:
        return True
    if not needed() or not _gate():
        return False
    layer_class = _layer_class()
    _state["original"] = layer_class._moments
    layer_class._moments = _make_moments(layer_class._moments)
    _state["applied"] = True
    return True


def _unapply():
    """Restores stock Keras (tests compare against it)."""
    if _state["applied"]:
        _layer_class()._moments = _state["original"]
    _state["applied"] = False
