"""Placement shared by the pipeline and model split: layers, gradients and slots on devices.

- `clone_chain`: the one way a chain of layers is copied onto devices (each copy's
  variables created under its part's device, the weights copied);
- `on_device`: a computation whose backward runs on the same device as its forward;
- `place_slots_with_variables`: optimizer slots created beside their variables (an upstream
  gap, worked around in `tfscale.compat.keras_optimizer_slots`).
"""

import tensorflow as tf

from tfscale.compat.keras_optimizer_slots import place_slots_with_variables
from tfscale.strategies._devices import device_key

__all__ = [
    "clone_chain",
    "device_of",
    "model_input",
    "on_device",
    "part_of_each_layer",
    "place_slots_with_variables",
    "variable_device",
]


def variable_device(variable):
    """The full device name of a Keras (or tf) variable's backing `tf.Variable`."""
    return getattr(variable, "value", variable).device


def device_of(variable):
    """The short device name (`/device:CPU:1`) a Keras or tf variable lives on."""
    device = variable_device(variable)
    job, _, kind, index = device_key(device)
    return device if job else f"/device:{kind}:{index}"


def part_of_each_layer(counts, parts):
    """Spreads `parts` (devices, stage indices) over layers: `counts[i]` layers get `parts[i]`."""
    return [part for count, part in zip(counts, parts) for _ in range(count)]


def clone_chain(layers, counts, devices, inputs):
    """Copies a chain of layers onto devices, `counts[i]` consecutive layers on `devices[i]`.

    Each copy (same class and config, so the same name and weights layout) is called on the
    previous copy's output under its device, which creates its variables there; then the
    original's weights are copied in.

    Args:
        layers: the chain, e.g. from `_partition.chain_layers(model)`.
        counts: layers per part, e.g. from `_partition.balance`.
        devices: one device name per part (repeats allowed: several stages on one device).
        inputs: a symbolic `keras.Input` for the first layer.

    Returns:
        (copies, placement, outputs): the copied layers, each one's device, and the symbolic
        output of the last copy.
    """
    placement = part_of_each_layer(counts, devices)
    copies, x = [], inputs
    for layer, device in zip(layers, placement):
        copy = type(layer).from_config(layer.get_config())
        with tf.device(device):
            x = copy(x)
        copy.set_weights(layer.get_weights())
        copies.append(copy)
    return copies, placement, x


def on_device(device, fn, *inputs):
    """Returns `fn(*inputs)` computed on `device`, with its gradient computed there too.

    `tf.device` places the forward ops, but `tf.GradientTape` builds the backward ops
    outside any device scope, so they would all run on the default device (each device's
    weights and activations copied there for every backward step). The forward is therefore
    recorded on an inner tape and differentiated inside the same `tf.device` scope.

    Args:
        device: the device name.
        fn: a function of tensors returning one tensor; it may read variables.
        *inputs: its tensor arguments (non-float ones get no gradient).

    Returns:
        The output tensor of `fn`.
    """

    @tf.custom_gradient
    def run(*xs):
        with tf.device(device), tf.GradientTape() as tape:
            # Distinct tensors per argument: with self-attention, query, key and value are
            # one tensor, and the tape would give each the gradient of all three uses.
            xs = [tf.identity(x) for x in xs]
            differentiable = [x for x in xs if x.dtype.is_floating]
            tape.watch(differentiable)
            y = fn(*xs)

        def grad(dy, variables=None):
            variables = list(variables or [])
            with tf.device(device):
                grads = tape.gradient(y, differentiable + variables, output_gradients=dy)
            it = iter(grads[: len(differentiable)])
            input_grads = [next(it) if x.dtype.is_floating else None for x in xs]
            return input_grads, grads[len(differentiable) :]

        return y, grad

    # The op that carries the custom gradient holds the output: keep it on the device too.
    with tf.device(device):
        return run(*[tf.convert_to_tensor(x) for x in inputs])


def model_input(model):
    """A fresh `keras.Input` like the model's single input, or None if the model is unbuilt."""
    import keras

    try:
        spec = model.inputs
    except (AttributeError, ValueError):
        spec = None
    if not spec:
        return None
    return keras.Input(batch_shape=spec[0].shape, dtype=spec[0].dtype, name=spec[0].name)
