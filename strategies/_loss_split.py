"""Cutting one batch's loss into slices (micro-batches, data-parallel replicas) that sum to it.

A pipeline computes the loss of each micro-batch, a data-parallel model of each replica's
slice; weighted by `slice_weights`, the slices' losses (and so their gradients) add up to
the loss Keras computes on the whole batch on one device.
"""

import keras
import tensorflow as tf

from tfscale.strategies._errors import StrategyError

__all__ = ["loss_reduction", "one_reduction", "slice_weights"]

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


def loss_reduction(loss):
    """The reduction of a compiled `loss`, checked: one scalar loss that slices can add up to."""
    if loss is None:
        raise StrategyError(
            "A pipelined or data-parallel model needs `loss` in `compile()`. Received: loss=None. Expected a "
            "Keras loss (name, function or `keras.losses.Loss`)."
        )
    if isinstance(loss, (list, tuple, dict)):
        raise StrategyError(
            f"Invalid value for argument `loss`. Received: loss={loss!r}. Expected a single "
            "loss: a pipeline or data-parallel split model has one output."
        )
    reduction = getattr(loss, "reduction", "sum_over_batch_size") if isinstance(loss, keras.Loss) else None
    reduction = reduction or "sum_over_batch_size"
    if reduction not in (*_MEAN_REDUCTIONS, "sum", "mean_with_sample_weight"):
        raise StrategyError(
            f"Invalid loss reduction for a model whose batch is cut into slices. Received: "
            f"reduction={reduction!r}. Expected 'sum_over_batch_size', 'mean', 'sum' or "
            "'mean_with_sample_weight' (a scalar loss)."
        )
    return reduction


def one_reduction(loss):
    """The one reduction of a compiled loss, or of every output's loss (`loss_reduction`).

    A model of several outputs cut into slices weighs each slice once for all its outputs:
    their losses must share the reduction.
    """
    if not isinstance(loss, (list, tuple, dict)):
        return loss_reduction(loss)
    reductions = {loss_reduction(leaf) for leaf in keras.tree.flatten(loss)}
    if len(reductions) != 1:
        raise StrategyError(
            f"Invalid value for argument `loss`. Received: loss={loss!r} with reductions "
            f"{sorted(reductions)}. Expected one reduction for every output of a model cut into slices."
        )
    return reductions.pop()


def slice_weights(reduction, sample_weights, num_slices, sizes=None):
    """w_i per slice, with sum_i w_i * loss(slice i) == loss(batch).

    Args:
        reduction: from `loss_reduction`.
        sample_weights: per slice its sample weights, or None.
        num_slices: the number of slices.
        sizes: per slice its number of samples (tensors), or None for equal slices.
    """
    if reduction == "sum":
        return [1.0] * num_slices
    if reduction == "mean_with_sample_weight" and sample_weights is not None:
        total = tf.add_n([tf.reduce_sum(w) for w in sample_weights])
        return [tf.math.divide_no_nan(tf.reduce_sum(w), total) for w in sample_weights]
    if sizes is not None:
        # Keras's mean divides by the batch's size: a slice of n_i samples weighs n_i / N.
        sizes = [tf.cast(n, tf.float32) for n in sizes]
        total = tf.add_n(sizes)
        return [tf.math.divide_no_nan(n, total) for n in sizes]
    return [1.0 / num_slices] * num_slices
