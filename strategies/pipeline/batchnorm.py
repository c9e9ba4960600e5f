"""Deferred batch normalisation for pipelined training (torchgpipe's `deferred_batch_norm`).

In training, a BatchNormalization layer of a pipeline stage normalises each micro-batch by
that micro-batch's own mean and variance (as in GPipe; the unsplit model uses the whole
batch's), and Keras would also move its averages once per micro-batch: M updates per step,
each from a 1/M-sized sample. Deferred, the M micro-batch moments are recorded, combined
into the whole batch's (means weighted by micro-batch size; the same mean of `var + mean^2`,
minus the squared mean), and the moving averages move once per batch from their values before
it, as the unsplit model's do.
"""

import keras
import tensorflow as tf
from keras import ops

from tfscale.strategies._replicas import layer_tree

__all__ = ["DeferredBatchNorm", "EmptyMicrobatchGuard", "batch_norm_layers"]


def batch_norm_layers(layers):
    """Every `BatchNormalization` in `layers`, those nested in custom layers included."""
    return [layer for layer in layer_tree(layers) if isinstance(layer, keras.layers.BatchNormalization)]


class DeferredBatchNorm:
    """Moves the moving averages of the BatchNormalization layers in `layers` once per batch.

    Layers with batch renormalisation or synchronised statistics keep Keras's own updates.
    """

    def __init__(self, layers):
        self.layers = [
            layer for layer in batch_norm_layers(layers) if not layer.renorm and not layer.synchronized
        ]

    def run(self, fn, num_microbatches):
        """Returns `fn()` (one batch of micro-batches), then moves the averages once."""
        # Read now (tensors, not the variables): the micro-batches' own updates follow.
        starts = [
            (layer.moving_mean.value.read_value(), layer.moving_variance.value.read_value())
            for layer in self.layers
        ]
        records = [[] for _ in self.layers]
        for layer, record in zip(self.layers, records):
            layer.call = _recording(layer, type(layer).call.__get__(layer), record)
        try:
            result = fn()
        finally:
            for layer in self.layers:
                del layer.call  # The class's own `call` again.
        for layer, start, record in zip(self.layers, starts, records):
            # Fewer records: masked inputs or training=False; more: a forward ran twice.
            if len(record) == num_microbatches:
                _move_averages(layer, start, record)
        return result


class EmptyMicrobatchGuard:
    """Keras's own per-micro-batch updates of the moving averages (deferred ones off), except
    that an empty micro-batch -- a final batch smaller than D x M -- leaves them as they
    were: its moments are NaN, and Keras never sees an empty batch."""

    def __init__(self, layers):
        self.layers = batch_norm_layers(layers)

    def run(self, fn, num_microbatches):
        del num_microbatches  # the same interface as `DeferredBatchNorm.run`
        for layer in self.layers:
            layer.call = _guarded(layer, type(layer).call.__get__(layer))
        try:
            return fn()
        finally:
            for layer in self.layers:
                del layer.call


def _guarded(layer, call):
    def guarded_call(inputs, training=None, mask=None):
        if not (training and layer.trainable):
            return call(inputs, training=training, mask=mask)
        averages = [layer.moving_mean, layer.moving_variance]
        # Read before the call (auto control dependencies keep the order); in a recompute's
        # StatelessScope these are its values.
        before = [tf.identity(ops.convert_to_tensor(v)) for v in averages]  # a copy, not the variable
        outputs = call(inputs, training=training, mask=mask)
        empty = tf.equal(tf.size(inputs), 0)
        for variable, value in zip(averages, before):
            variable.assign(tf.where(empty, value, ops.convert_to_tensor(variable)))
        return outputs

    return guarded_call


def _recording(layer, call, record):
    def recorded_call(inputs, training=None, mask=None):
        if training and layer.trainable and mask is None:
            x = ops.cast(inputs, keras.backend.result_type(inputs.dtype, "float32"))
            axis = layer.axis % len(x.shape)
            axes = [i for i in range(len(x.shape)) if i != axis]
            mean, variance = ops.moments(x, axes=axes)
            count = tf.cast(tf.size(x) // tf.shape(x)[axis], mean.dtype)  # values per channel
            record.append((mean, variance, count))
        return call(inputs, training=training, mask=mask)

    return recorded_call


def _move_averages(layer, start, record):
    with tf.device(layer.moving_mean.value.device):
        # Weighted by the micro-batches' sizes (a partial batch's differ; an empty one has
        # NaN moments and weight 0, so it is left out).
        counts = ops.stack([count for _, _, count in record])
        shares = ops.expand_dims(counts / ops.sum(counts), -1)
        means = ops.stack([tf.where(count > 0, mean, 0.0) for mean, _, count in record])
        variances = ops.stack([tf.where(count > 0, variance, 0.0) for _, variance, count in record])
        mean = ops.sum(means * shares, axis=0)
        variance = ops.sum((variances + ops.square(means)) * shares, axis=0) - ops.square(mean)
        p = layer.momentum
        layer.moving_mean.assign(start[0] * p + ops.cast(mean, start[0].dtype) * (1.0 - p))
        layer.moving_variance.assign(start[1] * p + ops.cast(variance, start[1].dtype) * (1.0 - p))
