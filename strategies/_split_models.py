"""The Keras model classes a split returns: ordinary Sequential / functional models, plus
device placement of each layer's call and of the optimizer's slot variables."""

import functools

import keras
import tensorflow as tf

__all__ = ["SplitFunctional", "SplitSequential", "device_of", "place_slots_with_variables"]


def device_of(variable):
    """The short device name (`/device:CPU:1`) a Keras or tf variable lives on."""
    value = getattr(variable, "value", variable)
    spec = tf.DeviceSpec.from_string(value.device)
    if spec.job not in (None, "localhost"):
        return value.device
    return f"/device:{spec.device_type}:{spec.device_index}"


def place_slots_with_variables(optimizer):
    """Makes the optimizer create each slot variable on its model variable's device.

    Keras 3 (3.0-3.15, TF backend) creates slots under `colocate_vars_with`, which eager
    mode ignores: every slot (Adam's momentum and velocity, SGD's momentum) would land on the
    default device, doubling or tripling that device's memory. `add_variable_from_reference`
    is the optimizer's public hook for slots, so it is wrapped on this instance only.
    """
    original = optimizer.add_variable_from_reference
    if getattr(original, "_tfscale_placed", False):
        return

    @functools.wraps(original)
    def placed(reference_variable, *args, **kwargs):
        with tf.device(device_of(reference_variable)):
            return original(reference_variable, *args, **kwargs)

    placed._tfscale_placed = True
    # The optimizer tracks attributes it is given; a bound hook is not state, so bypass that.
    object.__setattr__(optimizer, "add_variable_from_reference", placed)


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
        # `training` and masks reach each layer through Keras' call context.
        for layer, device in zip(self.layers, self._placement):
            with tf.device(device):
                x = layer(x)
        return x


class SplitFunctional(_PlacedSlots, keras.Model):
    """A functional `keras.Model` (built from inputs and outputs) with placed optimizer slots."""
