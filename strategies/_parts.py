"""What the pipeline and model split share once a model is cut: the report and the merge.

Both strategies turn a built Keras model into parts on devices (`split`), report where the
parameters live (`report`) and give back the unsplit model with the trained weights
(`merge`); these are the shared bodies of the last two.
"""

import keras
import tensorflow as tf

from tfscale.strategies._placement import TolerantClass, copy_state, device_of

__all__ = ["Origin", "merge", "report"]


class Origin:
    """How to rebuild the user's model: its class, config and custom layer classes."""

    def __init__(self, model):
        self.cls = type(model)
        self.config = model.get_config()
        self.custom_objects = {type(layer).__name__: TolerantClass(type(layer)) for layer in model.layers}
        # Custom activation functions, found again without being registered.
        for layer in model.layers:
            activation = getattr(layer, "activation", None)
            if callable(activation) and hasattr(activation, "__name__"):
                self.custom_objects.setdefault(activation.__name__, activation)
        self.names = [layer.name for layer in model.layers]


def merge(origin, split_model):
    """A new model of `origin`'s architecture holding `split_model`'s weights, by layer name.

    A split layer with `full_weights()` (tensor split) gives its unsplit weights; any
    other gives all its state (`copy_state`: weights and seed-generator states).
    """
    with keras.saving.custom_object_scope(origin.custom_objects):
        merged = origin.cls.from_config(origin.config)
    for layer, name in zip(merged.layers, origin.names):
        # A config without the name (an __init__ without **kwargs) gave a fresh one.
        layer.name = name
    for layer in merged.layers:
        if not layer.variables:
            continue
        part = split_model.get_layer(layer.name)
        if hasattr(part, "full_weights"):
            layer.set_weights(part.full_weights())
        else:
            copy_state(part, layer)
    return merged


def report(layers, devices):
    """Per device, read from each variable's device: layers, params and param bytes.

    Args:
        layers: the split model's layers.
        devices: the devices to list first, in order (each listed even if empty).

    Returns:
        A list of dicts with keys "device", "layers", "params", "param_bytes"; model
        variables only (optimizer slots not counted).
    """
    rows = {}
    for device in list(devices):
        rows.setdefault(device, {"device": device, "layers": [], "params": 0, "param_bytes": 0})
    for layer in layers:
        for variable in layer.weights:
            device = device_of(variable)
            row = rows.setdefault(device, {"device": device, "layers": [], "params": 0, "param_bytes": 0})
            size = int(tf.size(variable.value))
            row["params"] += size
            row["param_bytes"] += size * tf.as_dtype(variable.dtype).size
            if layer.name not in row["layers"]:
                row["layers"].append(layer.name)
    return list(rows.values())
