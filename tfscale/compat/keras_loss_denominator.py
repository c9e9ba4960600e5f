"""Keras 3 mean losses under `MirroredStrategy` / `MultiWorkerMirroredStrategy`: the one-device mean.

Checked on Keras 3.15.1 with TensorFlow 2.21 (the same code is in Keras 3.0 to 3.15).
Each replica of Keras's TF `train_step` computes its compiled loss on its own slice of the
batch. A mean reduction (`"sum_over_batch_size"`, the default, `"mean"` and
`"mean_with_sample_weight"`) divides the slice's weighted sum by the *slice's* denominator
(its element count, its count of valid mask entries, or its sum of sample weights:
`keras/src/losses/loss.py`, `reduce_values` and `apply_mask`), then
`scale_loss_for_distribution` multiplies by 1 / num_replicas, and the gradients are summed
over the replicas. That is the one-device mean only when every replica's denominator is the
same. It is not:

1. on a last batch split unevenly (3 samples over 2 replicas: 2 and 1; 1 sample: 1 and an
   empty slice), each replica's mean weighs 1/2, so the sample alone on its replica counts
   twice as much as on one device;
2. with a mask (e.g. a per-timestep loss after `Embedding(mask_zero=True)`), each replica
   divides by its own number of valid steps, which differ from replica to replica even on
   evenly split batches;
3. with `"mean_with_sample_weight"`, each replica divides by its own sum of weights.

The logged loss has the same fault from the other side: `train_step` / `test_step` (and
`CompileLoss`'s per-output metrics) log `unscale_loss_for_distribution(loss)`, i.e.
num_replicas x the replica's share, weighted by the replica's example count.

The fix, applied where Keras has these functions unfixed (`needed()`), only in the replica
context of a traced Mirrored / MultiWorkerMirrored step with 2+ replicas (elsewhere Keras's
own code runs unchanged):

- `reduce_weighted_values` (what every `keras.losses.Loss.__call__` reduces with) divides a
  replica's weighted sum by the *global* denominator: the replicas' local denominators
  (element count; valid mask entries and mask size; sum of weights), SUM-all-reduced across
  every replica in one launch. Each replica's loss is then its share of the one-device mean,
  the shares add up to it, and so do their gradients. Keras's weighting is kept exactly:
  the mask merged into the sample weights with its weight total / valid (the global counts),
  class weights (which reach the loss as sample weights), `loss_weights`, one denominator
  per loss term (a multi-output model's outputs each have their own). `"sum"` and `None`
  reductions, which never divide, are Keras's own (a sum's shares already add up).
- `unscale_loss_for_distribution` returns the SUM-all-reduce of the replica's scalar share:
  the one-device value on every replica, so the loss tracker (weighted by the example
  counts, which add up to the batch's) and `CompileLoss`'s per-output metrics log the
  one-device loss, in `fit` and `evaluate`. Regularisation losses (`model.losses`) keep
  Keras's 1 / num_replicas share, which the sum makes whole again.

An empty slice adds 0 to every sum and count: its replica's share is 0 and the others
divide by the global count, as one device does; a batch with no valid entry at all gives 0,
as Keras's `divide_no_nan` does on one device.

The all-reduce is launched on the strategy's own collective ops from replica context
(`keras_optimizer.all_reduce_exact`, no `merge_call`, no gradient compression: counts must
arrive exact), with the strategy's communication options. Not covered: `run_eagerly=True`
(eager replicas keep Keras's per-replica mean), TPUStrategy (same Keras code, not
exercisable here), a loss whose `call` returns a scalar (Keras returns it unreduced and
unscaled: nothing to divide), and `add_loss` terms that average over a replica's slice (a
layer's own mean of its slice: Keras gives no denominator to correct).

Reproducer (before the fix): Dense(2) on 4 inputs, 19 samples in batches of 8, SGD(0.1),
sparse categorical cross-entropy, `MirroredStrategy` on 2 CPUs: the last batch (3 samples)
splits 2 and 1 and the weights after one epoch differ from one device's by ~1e-3;
`tests/test_compat_loss_denominator.py` (uneven numpy and tf.data batches, an empty slice,
per-timestep masks, sample and class weights, two outputs, evaluate) fails without it.
Gate: this fix's own `_FIXED_IN` (None while upstream is unfixed), and the patched
functions' presence in `keras.src.losses.loss`; otherwise nothing is changed.
`tfscale.strategies.get("mirrored" | "multi_worker")` applies it; users who build those
strategies by hand call `tfscale.compat.apply_loss_fixes()` once.
"""

import functools

import keras
import tensorflow as tf

from tfscale.compat import keras_optimizer
from tfscale.compat.keras_multi_worker import _version_tuple

__all__ = ["CHECKED_ON", "apply", "is_applied", "needed"]

CHECKED_ON = ("3.15.1", "2.21.0")
# First Keras release whose mean losses divide by the global denominator under tf.distribute;
# None while upstream is unfixed.
_FIXED_IN = None
_MEANS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")
_PATCHED = ("reduce_weighted_values", "unscale_loss_for_distribution")
_REQUIRED = (*_PATCHED, "apply_mask", "squeeze_or_expand_to_same_rank", "standardize_reduction")
_state = {"applied": False, "originals": {}}


def needed(version=None):
    """True when this Keras version divides a replica's mean loss by its local denominator."""
    version = _version_tuple(version or keras.__version__)
    if version < (3,):
        return False
    return _FIXED_IN is None or version < _version_tuple(_FIXED_IN)


def is_applied():
    """True once `apply()` has patched this process's Keras losses."""
    return _state["applied"]


def _loss_module():
    from keras.src.losses import loss

    return loss


def _active():
    """In the replica context of a traced Mirrored/MWMS step with 2 or more replicas."""
    return keras_optimizer._active() and tf.distribute.get_strategy().num_replicas_in_sync > 1


def _wire_dtype(dtype):
    # Counts travel in float32 at least: float16 holds integers exactly only up to 2048.
    return tf.float32 if dtype.size < 4 else dtype


def _all_reduce(values, dtype):
    """The SUM over every replica of each scalar in `values`, cast back to `dtype`."""
    wire = _wire_dtype(dtype)
    local = tf.stack([tf.cast(tf.stop_gradient(v), wire) for v in values])
    total = keras_optimizer.all_reduce_exact([local])[0]
    return [tf.cast(total[i], dtype) for i in range(len(values))]


def _make_reduce_weighted_values(original, loss):
    ops = keras.ops

    def size(x, dtype):
        return ops.cast(ops.prod(ops.convert_to_tensor(ops.shape(x), dtype="int32")), dtype)

    def reduce_weighted_values(
        values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None
    ):
        reduction = loss.standardize_reduction(reduction)
        keras_own = functools.partial(
            original, values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype
        )
        if reduction not in _MEANS or not _active():
            return keras_own()
        # Keras's steps (`reduce_weighted_values`, `apply_mask`, `reduce_values`), with
        # every denominator summed over the replicas before it divides.
        values = ops.convert_to_tensor(values, dtype=dtype)
        if sample_weight is not None:
            sample_weight = ops.convert_to_tensor(sample_weight, dtype=dtype)
        counts = []
        if mask is not None:
            mask = ops.convert_to_tensor(mask, dtype=dtype)
            if reduction in ("mean", "sum_over_batch_size"):
                # Keras weighs each valid entry total / valid: the mask's size and valid count.
                counts = [size(mask, values.dtype), ops.sum(ops.cast(mask, dtype=values.dtype))]
        # The mask joins the weights as 0/1 (`apply_mask`'s other branch); total / valid
        # multiplies the sum below, once the global counts are known.
        sample_weight = loss.apply_mask(sample_weight, mask, dtype=values.dtype, reduction="sum")
        if sample_weight is not None:
            sample_weight = ops.cast(sample_weight, values.dtype)
            values, sample_weight = loss.squeeze_or_expand_to_same_rank(values, sample_weight)
            values = values * sample_weight
        if tuple(values.shape) in ((), (0,)):
            return keras_own()  # Keras returns these unreduced and unscaled: nothing to divide.
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            divisor = ops.cast(ops.sum(sample_weight), values.dtype)
        else:
            divisor = size(values, values.dtype)
        divisor, *counts = _all_reduce([divisor, *counts], values.dtype)
        weighted_sum = ops.sum(values)
        if counts:
            weighted_sum = weighted_sum * ops.divide_no_nan(counts[0], counts[1])
        return ops.divide_no_nan(weighted_sum, divisor)

    return reduce_weighted_values


def _make_unscale_loss_for_distribution(original):
    def unscale_loss_for_distribution(value):
        if not _active() or not tf.is_tensor(value) or value.shape.rank != 0:
            return original(value)
        # Every replica's loss is its share of the one-device value: their sum is that value.
        return _all_reduce([value], value.dtype)[0]

    return unscale_loss_for_distribution


def _gate():
    loss = _loss_module()
    return all(callable(getattr(loss, name, None)) for name in _REQUIRED)


def apply():
    """Patches Keras 3's mean losses for one-device semantics under data parallelism.

    Idempotent. Does nothing where upstream is fixed or the patched functions are gone.

    Returns:
        True if the fix is in effect after the call, False if not.
    """
    if _state["applied"]:
        return True
    if not needed() or not _gate():
        return False
    loss = _loss_module()
    originals = {name: getattr(loss, name) for name in _PATCHED}
    loss.reduce_weighted_values = _make_reduce_weighted_values(originals["reduce_weighted_values"], loss)
    loss.unscale_loss_for_distribution = _make_unscale_loss_for_distribution(
        originals["unscale_loss_for_distribution"]
    )
    _state["originals"] = originals
    _state["applied"] = True
    return True


def _unapply():
    """Restores stock Keras (tests compare against it)."""
    loss = _loss_module()
    for name, original in _state["originals"].items():
        setattr(loss, name, original)
    _state["applied"] = False
