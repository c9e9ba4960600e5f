"""Placement shared by the pipeline and model split: layers, gradients and slots on devices.

- `clone_chain`: the one way a chain of layers is copied onto devices (each copy's
  variables created under its part's device, its state copied); `clone_layer` and
  `copy_state` are its two halves, also used by tensor split for the layers it keeps whole;
- `on_device`: a computation whose backward runs on the same device as its forward;
- `place_slots_with_variables`: optimizer slots created beside their variables (an upstream
  gap, worked around in `tfscale.compat.keras_optimizer_slots`).
"""

import inspect

import keras
import tensorflow as tf

from tfscale.compat.keras_optimizer_slots import place_slots_with_variables
from tfscale.strategies._devices import device_key
from tfscale.strategies._errors import StrategyError

__all__ = [
    "clone_chain",
    "clone_layer",
    "copy_state",
    "device_of",
    "model_input",
    "on_device",
    "on_device_many",
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

    Each copy (`clone_layer`: same class and config, so the same name and weights layout)
    is called on the previous copy's symbolic output under its device, which builds it (and
    any sub-layers made in `__init__`) there, as running the layer does; then the
    original's state is copied in (`copy_state`: weights and seed-generator states).

    Args:
        layers: the chain, e.g. from `_partition.chain_layers(model)`.
        counts: layers per part, e.g. from `_partition.balance`.
        devices: one device name per part (repeats allowed: several stages on one device).
        inputs: a symbolic `keras.Input` for the first layer.

    Returns:
        (copies, placement, outputs): the copied layers, each one's device, and the symbolic
        output of the last copy.

    Raises:
        StrategyError: a layer that cannot be copied (names it and what it must provide).
    """
    placement = part_of_each_layer(counts, devices)
    copies, x = [], inputs
    for layer, device in zip(layers, placement):
        # Made under the device too: Keras builds nested layers of a config (Bidirectional's
        # LSTMs) as it deserializes them, before the copy is ever called.
        with tf.device(device):
            copy = clone_layer(layer)
            x = copy(x)
        copy_state(layer, copy)
        copies.append(copy)
    return copies, placement, x


# What `keras.layers.Layer.get_config` adds to every layer's config (`Layer(**kwargs)`).
_BASE_KEYS = ("name", "trainable", "dtype")


def clone_layer(layer):
    """A new, unbuilt layer with `layer`'s class and config, made as Keras loads a model.

    The layer's class and activation function are in scope, as `custom_objects` are for
    `keras.models.load_model`. A layer whose `__init__` takes no `**kwargs` (so not
    Keras's base `name` / `trainable` / `dtype`) is made from the rest of its config and
    given those three afterwards.

    Raises:
        StrategyError: `from_config(get_config())` fails; names the layer and the fix.
    """
    cls, config = type(layer), layer.get_config()
    try:
        with keras.saving.custom_object_scope(_custom_objects(layer)):
            # `get_config` of an __init__ without **kwargs may lack the name: keep it.
            return tolerant_from_config(cls, {**config, "name": layer.name})
    except Exception as error:  # Any failure of the user's code is reported as one line.
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        raise StrategyError(
            f"Cannot copy layer {layer.name!r} ({cls.__name__}): {cls.__name__}.from_config("
            f"layer.get_config()) failed ({type(error).__name__}: {first}). Expected get_config() "
            "to return every __init__ argument, and from_config() to rebuild any object argument "
            "(layers, initializers) from its config."
        ) from error


def _custom_objects(layer):
    objects = {type(layer).__name__: type(layer)}
    activation = getattr(layer, "activation", None)
    if callable(activation) and hasattr(activation, "__name__"):
        objects[activation.__name__] = activation
    return objects


def _takes_only_own_arguments(cls, config):
    """Whether `cls.__init__` rejects base keys present in `config` (no `**kwargs`)."""
    if cls.from_config.__func__ is not keras.layers.Layer.from_config.__func__:
        return False  # The user's own from_config: its failure is theirs to fix.
    parameters = inspect.signature(cls.__init__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return False
    names = {p.name for p in parameters}
    return any(key in config and key not in names for key in _BASE_KEYS)


def tolerant_from_config(cls, config):
    """`cls.from_config(config)`, or, for an `__init__` without `**kwargs`, `cls(**own)`
    with Keras's base arguments (`name`, `trainable`, `dtype`) set afterwards."""
    try:
        return cls.from_config(config)
    except TypeError:
        if not _takes_only_own_arguments(cls, config):
            raise
    names = set(inspect.signature(cls.__init__).parameters)
    copy = cls(**{k: v for k, v in config.items() if k not in _BASE_KEYS or k in names})
    # Set before the copy is built: variable paths and weights files use the name.
    if "name" in config:
        copy.name = config["name"]
    copy.trainable = config.get("trainable", True)
    if "dtype" in config:
        copy.dtype_policy = config["dtype"]
    return copy


class TolerantClass:
    """Stands for a layer class in `custom_objects`: Keras's deserialization calls its
    `from_config`, which is `tolerant_from_config` (for `__init__`s without `**kwargs`)."""

    def __init__(self, cls):
        self.cls = cls

    def from_config(self, config):
        return tolerant_from_config(self.cls, config)


def copy_state(source, target):
    """Copies all of `source`'s variables into `target` (a copy of it): weights, and the
    seed-generator states (so a copied Dropout draws the same masks as the original).

    Raises:
        StrategyError: the two layers' variables differ in number or shape.
    """
    pairs = list(zip(source.variables, target.variables))
    if len(source.variables) != len(target.variables) or any(a.shape != b.shape for a, b in pairs):
        raise StrategyError(
            f"Cannot copy layer {source.name!r} ({type(source).__name__}): the copy has variables "
            f"{[tuple(v.shape) for v in target.variables]}, the original "
            f"{[tuple(v.shape) for v in source.variables]}. Expected the layer to create the "
            "same variables whenever it is built from its config and run on the same input."
        )
    for a, b in pairs:
        b.assign(a.value)


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


def on_device_many(device, fn, inputs):
    """`on_device` for a function of several tensors returning a list of tensors.

    The float outputs carry gradients, computed on `device`; any other output (integer ids,
    a boolean mask) comes back as it is, with no gradient. An output no later computation
    uses gets a zero gradient.

    Args:
        device: the device name.
        fn: a function of tensors returning a list of tensors; it may read variables.
        inputs: its tensor arguments (non-float ones get no gradient).

    Returns:
        The list of `fn`'s outputs.
    """
    outputs = []

    @tf.custom_gradient
    def run(*xs):
        with tf.device(device), tf.GradientTape() as tape:
            xs = [tf.identity(x) for x in xs]  # distinct tensors per argument (see on_device)
            differentiable = [x for x in xs if x.dtype.is_floating]
            tape.watch(differentiable)
            outputs.extend(fn(*xs))
            floats = [y for y in outputs if y.dtype.is_floating]
            # custom_gradient needs an output: a part that gives only integers gives this too.
            floats = floats or [tf.zeros(())]

        def grad(*dys, variables=None):
            variables = list(variables or [])
            dys = [tf.zeros_like(y) if dy is None else dy for y, dy in zip(floats, dys)]
            with tf.device(device):
                grads = tape.gradient(floats, differentiable + variables, output_gradients=dys)
            it = iter(grads[: len(differentiable)])
            input_grads = [next(it) if x.dtype.is_floating else None for x in xs]
            return input_grads, grads[len(differentiable) :]

        return floats, grad

    with tf.device(device):
        results = iter(run(*[tf.convert_to_tensor(x) for x in inputs]))
    return [next(results) if y.dtype.is_floating else y for y in outputs]


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
