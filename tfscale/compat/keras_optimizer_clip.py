"""`clipnorm` of a variable held as shards (tensor split) clips by the whole variable's norm.

Upstream gap: a Keras optimizer with `clipnorm` clips each gradient by its own norm
(`BaseOptimizer._clip_gradients`, private), and nothing tells it that several variables
are the shards of one (a tensor-split layer holds each weight as K shards on K devices):
each shard would be clipped by its shard's norm, not by the whole weight's, as Keras on
one device does. The gradients reach `_clip_gradients` with no variables, so the
variables are taken from `_backend_apply_gradients(grads, trainable_variables)` (private,
the caller of `_clip_gradients` on both the plain and the gradient-accumulation path);
with `clipnorm` set, the gradients of one group are scaled by the group's norm, with
`tf.clip_by_norm`'s formula. `global_clipnorm` and `clipvalue` need nothing: the global
norm is the same sum of squares, and `clipvalue` acts on each number.

Checked on Keras 3.15.1 / TensorFlow 2.21 (both methods exist in Keras 3.0-3.15).
Gate: the two attributes; `tests/test_model_split_keras_equivalence.py` fails when either
changes name or role (tensor split with clipnorm then differs from one device).
"""

import tensorflow as tf

from tfscale.compat._errors import UnsupportedVersionError

__all__ = ["clip_norm_by_groups"]

_MARK = "_tfscale_clip_groups"


def clip_norm_by_groups(optimizer, group_of):
    """Makes `optimizer`'s `clipnorm` clip each group of variables by the group's norm.

    Args:
        optimizer: a Keras optimizer (a `LossScaleOptimizer`'s inner optimizer too).
        group_of: variable -> a key shared by the shards of one weight, or None for a
            variable that is a whole weight (clipped alone, as Keras does).

    Idempotent: a later call replaces `group_of`.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is not None:
        clip_norm_by_groups(inner, group_of)
    if getattr(optimizer, _MARK, None) is not None:
        object.__setattr__(optimizer, _MARK, group_of)
        return
    if not (hasattr(optimizer, "_backend_apply_gradients") and hasattr(optimizer, "_clip_gradients")):
        raise UnsupportedVersionError(
            "This Keras optimizer has no `_backend_apply_gradients` / `_clip_gradients` (checked "
            "on Keras 3.0-3.15); tfscale.compat.keras_optimizer_clip needs updating."
        )
    apply, clip = optimizer._backend_apply_gradients, optimizer._clip_gradients
    applying = []  # the variables of the update being traced (a stack: calls do not nest)

    def apply_recording(grads, trainable_variables):
        applying.append(list(trainable_variables))
        try:
            return apply(grads, trainable_variables)
        finally:
            applying.pop()

    def clip_grouped(grads):
        norm = optimizer.clipnorm
        if not (norm and norm > 0) or not applying or len(applying[-1]) != len(grads):
            return clip(grads)
        keys = [getattr(optimizer, _MARK)(v) for v in applying[-1]]
        return _clip_groups(list(grads), keys, norm, clip)

    object.__setattr__(optimizer, _MARK, group_of)
    # The optimizer tracks attributes it is given; a bound hook is not state, so bypass that.
    object.__setattr__(optimizer, "_backend_apply_gradients", apply_recording)
    object.__setattr__(optimizer, "_clip_gradients", clip_grouped)


def _values(gradient):
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _clip_groups(grads, keys, clip_norm, clip_alone):
    groups = {}
    for i, (gradient, key) in enumerate(zip(grads, keys)):
        if gradient is not None:
            groups.setdefault(("whole", i) if key is None else key, []).append(i)
    clipped = list(grads)
    for members in groups.values():
        if len(members) == 1:  # a whole weight: Keras's own clip, bit for bit
            clipped[members[0]] = clip_alone([grads[members[0]]])[0]
            continue
        values = [_values(grads[i]) for i in members]
        # tf.clip_by_norm's formula, with the squared norm summed over the shards.
        l2sum = tf.add_n([tf.reduce_sum(v * v) for v in values])
        positive = l2sum > 0
        safe = tf.where(positive, l2sum, tf.ones_like(l2sum))
        l2norm = tf.where(positive, tf.sqrt(safe), l2sum)
        for i in members:
            with tf.device(_values(grads[i]).device):
                values_i = _values(grads[i])
                cut = values_i * tf.cast(clip_norm, values_i.dtype) / tf.maximum(l2norm, clip_norm)
                clipped[i] = (
                    tf.IndexedSlices(cut, grads[i].indices, grads[i].dense_shape)
                    if isinstance(grads[i], tf.IndexedSlices)
                    else cut
                )
    return clipped
