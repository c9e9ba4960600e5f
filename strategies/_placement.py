"""Keeping computation, gradients and optimizer state on the device that holds the weights."""

import functools

import tensorflow as tf

__all__ = ["device_of", "on_device", "place_slots_with_variables"]


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
