"""The Keras model classes a split returns: ordinary Sequential / functional models, plus
device placement of each layer's call and of the optimizer's slot variables."""

import itertools

import keras
import tensorflow as tf

from tfscale.compat import keras_compile_loss
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._loss_split import loss_reduction, slice_weights
from tfscale.strategies._placement import on_device, place_slots_with_variables
from tfscale.strategies._replicas import Replicas, SyncedReplicas, draw_as_whole_batch

__all__ = ["DataParallelSplit", "SplitFunctional", "SplitSequential"]


class _PlacedSlots:
    """Mixin: `compile` places the optimizer's slots with their variables."""

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        place_slots_with_variables(self.optimizer)


class SplitSequential(_PlacedSlots, keras.Sequential):
    """A `keras.Sequential` whose layer i runs under `tf.device(placement[i])`.

    Its layers (classes, order, weights) are those of the model it was split from, so its
    `save_weights` file has the same layout and loads into that model, and back.
    """

    def __init__(self, layers, placement=None, name=None):
        super().__init__(layers, name=name)
        self._placement = tuple(placement) if placement else None

    def call(self, inputs, training=None, mask=None):
        if self._placement is None:
            return super().call(inputs, training=training, mask=mask)
        x = inputs
        # One hop per group of consecutive layers on a device; `training` and masks reach
        # each layer through Keras' call context.
        steps = zip(self.layers, self._placement)
        for device, group in itertools.groupby(steps, key=lambda step: step[1]):
            x = on_device(device, _chain([layer for layer, _ in group]), x)
        return x


def _chain(layers):
    def run(x):
        for layer in layers:
            x = layer(x)
        return x

    return run


class SplitFunctional(_PlacedSlots, keras.Model):
    """A functional `keras.Model` (built from inputs and outputs) with placed optimizer slots."""


class _Others:
    """Replicas 1..D-1 of a data-parallel split: a plain holder, so Keras tracks only replica 0."""

    def __init__(self, models, replicas):
        self.models = list(models)
        self.replicas = replicas


class DataParallelSplit(SyncedReplicas, keras.Model):
    """D copies of a split model, each on its own group of devices, trained as one model.

    Replica r takes the r-th 1/D of every batch; each part's gradients are summed over the
    D replicas (`tfscale.strategies._replicas`) before every replica applies them. It
    predicts, evaluates and saves as replica 0 (`primary`), the split model with the user's
    layers: its weights files load into the user's model.
    """

    def __init__(self, models, name=None):
        super().__init__(name=name or f"{models[0].name}_data_parallel")
        self.primary = models[0]
        self._others = _Others(models[1:], Replicas([[m] for m in models]))
        for r, model in enumerate(models):
            draw_as_whole_batch([model], r, len(models))  # Dropout's masks: one device's
        self.built = True

    @property
    def replica_models(self):
        return [self.primary, *self._others.models]

    def _data_parallel(self):
        return self._others.replicas

    def call(self, inputs, training=False):
        return self.primary(inputs, training=training)

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        loss_reduction(self.loss)
        place_slots_with_variables(self.optimizer)
        self.primary.optimizer = self.optimizer  # its weights file holds the optimizer

    def fit(self, *args, **kwargs):
        self._prepare_replicas()
        return super().fit(*args, **kwargs)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        models, d = self.replica_models, len(self.replica_models)
        n = x.shape[0]
        if n is not None and n % d:
            raise StrategyError(
                f"Invalid value for argument `data_parallel`. Received: data_parallel={d} for a batch "
                f"of {n} samples. Expected batch sizes that are multiples of {d}."
            )
        xs, ys = tf.split(x, d), tf.split(y, d)
        sws = None if sample_weight is None else tf.split(sample_weight, d)
        weights = slice_weights(loss_reduction(self.loss), sws, d)
        loss_object = keras_compile_loss.compiled_loss(self)
        gradients, terms, y_preds = [], [], []
        for r, model in enumerate(models):
            with tf.GradientTape() as tape:
                y_pred = model(xs[r], training=True)
                value = loss_object(ys[r], y_pred, None if sws is None else sws[r]) * weights[r]
                # The weight penalty: 1/D from each replica adds up to one penalty.
                penalty = tf.add_n(model.losses) if model.losses else None
                total = value if penalty is None else value + penalty / d
                scaled = self.optimizer.scale_loss(total)
            grads = tape.gradient(scaled, model.trainable_variables)
            gradients.append(
                [tf.zeros_like(v) if g is None else g for g, v in zip(grads, model.trainable_variables)]
            )
            terms.append(value if penalty is None or r else value + penalty)
            y_preds.append(y_pred)
        replicas = self._data_parallel()
        replicas.apply(replicas.all_reduce(gradients))
        keras_compile_loss.update_loss_tracker(self, tf.add_n(terms), tf.shape(x)[0])
        return self.compute_metrics(x, y, tf.concat(y_preds, axis=0), sample_weight=sample_weight)

    def get_layer(self, name=None, index=None):
        """A layer of replica 0 (the user's layers), by name or index: e.g. to freeze it."""
        return self.primary.get_layer(name=name, index=index)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Writes replica 0's weights file (the user's model's layout)."""
        return self.primary.save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a weights file of the user's model into every replica."""
        result = self.primary.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self._data_parallel().sync()
        return result
