"""The Keras model classes a split returns: ordinary Sequential / functional models, plus
device placement of each layer's call and of the optimizer's slot variables."""

import itertools

import keras

from tfscale.strategies._placement import on_device, place_slots_with_variables

__all__ = ["SplitFunctional", "SplitSequential"]


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
