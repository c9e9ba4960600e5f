"""Keras 3 losses under `MirroredStrategy` / `MultiWorkerMirroredStrategy`: the one-device loss.

Checked on Keras 3.15.1 with TensorFlow 2.21.0 only.
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

The logged loss is off too, and also for `"sum"` (whose gradients are right): `train_step`
/ `test_step` and `CompileLoss`'s per-output metrics log `unscale_loss_for_distribution(loss)`
(num_replicas x the replica's value) weighted by the replica's example count, which is the
one-device loss only when the slices are equal.

The fix, applied where Keras has this unfixed (`needed()`), replaces
`keras.src.losses.loss.reduce_weighted_values` (what every `keras.losses.Loss.__call__`
reduces with), and changes it only in the replica context of a traced Mirrored /
MultiWorkerMirrored step with 2+ replicas (elsewhere Keras's own function runs):

- Keras's own steps, except that the slice's weighted sum and its denominators (element
  count; mask size and valid count; sum of weights) are SUM-all-reduced across every
  replica, in one launch per loss term, before anything divides. Keras's weighting is kept:
  the mask merged into the sample weights with the weight total / valid (the global
  counts), class weights (which reach the loss as sample weights), `loss_weights` (applied
  by `CompileLoss` after), one denominator per loss term (each output of a multi-output
  model has its own). `None` / `"none"` reductions are Keras's own.
- The replica's loss *differentiates* as its share, local weighted sum / global
  denominator: the shares' gradients add up to the one-device gradient. Its *value* is
  `scale_loss_for_distribution(one-device loss)` (`local + stop_gradient(value - local)`),
  the same on every replica, so Keras's unchanged `unscale_loss_for_distribution` gives the
  one-device loss back and the loss tracker and per-output loss metrics log it, in `fit`
  and `evaluate`. Regularisation losses (`model.losses`) keep Keras's 1 / num_replicas share.

An empty slice adds 0 to every sum and count: its replica's share is 0 and the others
divide by the global count, as one device does; a batch with no valid entry at all gives 0,
as Keras's `divide_no_nan` does on one device.

The all-reduce is launched on the strategy's own collective ops from replica context
(`keras_optimizer.all_reduce_exact`: no `merge_call`, no gradient compression, since counts
must arrive exact), with the strategy's communication options: one more small launch a step
per loss term (two float32 numbers, four with a mask), beside the gradients'. Not covered:
`run_eagerly=True` (eager replicas keep Keras's per-replica mean), TPUStrategy (same Keras
code, not exercisable here), a loss whose `call` returns a scalar (Keras returns it
unreduced and unscaled: nothing to divide), an overridden `compute_loss` that does not
reduce with a `keras.losses.Loss`, and `add_loss` terms that average over a replica's slice
(a layer's own mean of its slice: Keras gives no denominator to correct).

Reproducer (before the fix): Dense(8) and Dense(2) on 4 inputs, 19 samples in batches of 8,
Adam(0.05), sparse categorical cross-entropy, `MirroredStrategy` on 2 CPUs: the last batch
(3 samples) splits 2 and 1, and after 2 epochs the weights differ from one device's by 0.13
and the logged loss by 0.018. `tests/test_compat_loss_denominator.py` (uneven numpy and
tf.data batches, an empty slice, per-timestep masks, sample and class weights, `"sum"`, two
outputs, evaluate; 2 workers x 2 replicas) fails without it.
Gate: this fix's own `_FIXED_IN` (None while upstream is unfixed), and the functions it
calls present in `keras.src.losses.loss`; otherwise nothing is changed.
`tfscale.strategies.get("mirrored" | "multi_worker")` applies it; users who build those
strategies by hand call `tfscale.compat.apply_loss_fixes()` once.
"""

import functools

import keras
import tensorflow as tf

from tfscale.compat import keras_optimizer
from tfscale.compat.keras_multi_worker import _version_tuple

__all__ = ["CHECKED_ON", "NAME_SCOPE", "apply", "is_applied", "needed"]

CHECKED_ON = ("3.15.1", "2.21.0")
# The name scope of this fix's all-reduce ops: what tells them from the gradients' launches
# in a traced graph or a profile (`strategies._communication.traced_all_reduces`).
NAME_SCOPE = "tfscale_loss_denominator"
# First Keras release whose mean losses divide by the global denominator under tf.distribute;
# None while upstream is unfixed.
_FIXED_IN = None
_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight", "sum")
_PATCHED = "reduce_weighted_values"
_REQUIRED = (
    _PATCHED,
    "apply_mask",
    "squeeze_or_expand_to_same_rank",
    "standardize_reduction",
    "scale_loss_for_distribution",
    "unscale_loss_for_distribution",
)
_state = {"applied": False, "original": None}


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
    with tf.name_scope(NAME_SCOPE):
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
        if reduction not in _REDUCTIONS or not _active():
            return keras_own()
        # Keras's steps (`reduce_weighted_values`, `apply_mask`, `reduce_values`), with
        # the weighted sum and every denominator summed over the replicas.
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
        local_sum = ops.sum(values)
        if reduction == "sum":
            (global_sum,) = _all_reduce([local_sum], values.dtype)
            return _share(local_sum, global_sum, loss)
        if reduction == "mean_with_sample_weight" and sample_weight is not None:
            divisor = ops.cast(ops.sum(sample_weight), values.dtype)
        else:
            divisor = size(values, values.dtype)
        global_sum, divisor, *counts = _all_reduce([local_sum, divisor, *counts], values.dtype)
        if counts:
            factor = ops.divide_no_nan(counts[0], counts[1])
            local_sum, global_sum = local_sum * factor, global_sum * factor
        return _share(ops.divide_no_nan(local_sum, divisor), ops.divide_no_nan(global_sum, divisor), loss)

    return reduce_weighted_values


def _share(local, whole, loss):
    """`local`'s gradient with Keras's distributed value of `whole` (whole / num_replicas).

    The gradients of the replicas' `local` add up to the gradient of the one-device loss;
    the value is what Keras's `unscale_loss_for_distribution` turns back into `whole`, the
    one-device loss, on every replica (so the loss tracker and per-output loss metrics,
    weighted by example counts that add up to the batch's, log it).
    """
    return local + tf.stop_gradient(loss.scale_loss_for_distribution(whole) - local)


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
    _state["original"] = loss.reduce_weighted_values
    loss.reduce_weighted_values = _make_reduce_weighted_values(loss.reduce_weighted_values, loss)
    _state["applied"] = True
    return True


def _unapply():
    """Restores stock Keras (tests compare against it)."""
    if _state["applied"]:
        _loss_module().reduce_weighted_values = _state["original"]
    _state["applied"] = False
