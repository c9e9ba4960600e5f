"""What the pipeline and model split share once a model is cut: the report and the merge.

Both strategies turn a built Keras model into parts on devices (`split`), report where the
parameters live (`report`) and give back the unsplit model with the trained weights
(`merge`); these are the shared bodies of the last two.
"""

import copy
import logging

import keras
import tensorflow as tf

from tfscale.compat import keras_optimizer_state
from tfscale.strategies._placement import TolerantClass, copy_state, device_of

__all__ = ["Origin", "merge", "report"]

_log = logging.getLogger("tfscale")


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


def merge(origin, split_model, compiled=None):
    """A new model of `origin`'s architecture holding `split_model`'s weights, by layer name.

    A split layer with `full_weights()` (tensor split) gives its unsplit weights; any
    other gives all its state (`copy_state`: weights and seed-generator states). Each
    layer keeps the split one's `trainable` flag. When `compiled` (the model `split`
    returned) is compiled, the merged model is compiled the same way and its optimizer
    holds `compiled`'s optimizer state (iterations, learning rate, slots), so `fit` on it
    continues as the split model would (and as plain Keras does).
    """
    with keras.saving.custom_object_scope(origin.custom_objects):
        # A copy: Keras's `functional_from_config` empties the config it is given, and a
        # model is merged more than once (save, then merge again).
        merged = origin.cls.from_config(copy.deepcopy(origin.config))
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
        layer.trainable = part.trainable
    if compiled is not None:
        _carry_optimizer(compiled, split_model, merged)
    return merged


def _carry_optimizer(compiled, split_model, merged):
    """Compiles `merged` as `compiled` is and copies `compiled`'s optimizer state into it.

    Slots are matched through the names Keras gives them (`add_variable_from_reference`:
    the model variable's path, "/" as "_", then the slot's name), a tensor-split layer's
    shards gathered by its own `full_weights`; the other optimizer variables (iterations,
    learning rate, loss scale) by name; what names cannot match (Adafactor's per-variable
    lists, Nadam's `_u_product`) through `tfscale.compat.keras_optimizer_state`.
    """
    if not getattr(compiled, "compiled", False) or getattr(compiled, "optimizer", None) is None:
        return
    try:
        merged.compile_from_config(compiled.get_compile_config())
    except (TypeError, ValueError) as error:  # e.g. a custom loss Keras cannot rebuild
        _log.warning(
            "merge: the merged model is not compiled (%s: %s); compile it to train it, "
            "without the split model's optimizer state.",
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        return
    source, target = compiled.optimizer, getattr(merged, "optimizer", None)
    if target is None or not source.built:
        return  # A class that overrides compile() (Keras then skips it), or nothing trained yet.
    if not target.built:
        target.build(merged.trainable_variables)
    sources = {v.name: v for v in source.variables}
    done = set()  # ids of the target's variables already given a value
    for layer in merged.layers:
        if layer.weights:
            part = split_model.get_layer(layer.name)
            _carry_layer_slots(source, target, part, layer, sources=sources, done=done)
    for variable in target.variables:
        found = sources.get(variable.name)
        if id(variable) not in done and found is not None and tuple(found.shape) == tuple(variable.shape):
            variable.assign(found.value)  # not marked: an attribute match below is surer
    for variable, found in keras_optimizer_state.attribute_pairs(source, target):
        _assign(variable, found.value, done)


def _carry_layer_slots(source, target, part, layer, *, sources, done):
    """The slots of `layer`'s variables, from those of `part` (the layer in the split model)."""
    for value, target_slot in _slots(part, layer, sources, target.variables):
        _assign(target_slot, value, done)
    if not hasattr(part, "full_weights"):
        for mine, theirs in zip(layer.trainable_weights, part.trainable_weights):
            for target_slot, found in keras_optimizer_state.indexed_pairs(source, target, theirs, mine):
                _assign(target_slot, found.value, done)


def _assign(variable, value, done):
    """Gives `variable` the value once: a slot matched surely is not overwritten by a weaker match."""
    if id(variable) not in done:
        variable.assign(value)
        done.add(id(variable))


def _slot_prefix(variable):
    return variable.path.replace("/", "_") + "_"


def _slots(part, layer, sources, targets):
    """(a slot's value in the split optimizer, the merged optimizer's slot it becomes)."""
    for weight_index, variable in enumerate(layer.weights):
        prefix = _slot_prefix(variable)
        for target_slot in targets:
            if not target_slot.name.startswith(prefix):
                continue
            suffix = target_slot.name[len(prefix) :]
            if hasattr(part, "full_weights"):
                value = _gathered(part, suffix, sources)
                value = None if value is None else value[weight_index]
            else:
                found = sources.get(_slot_prefix(part.weights[weight_index]) + suffix)
                value = None if found is None else found.value
            if value is not None:
                yield value, target_slot


def _gathered(part, suffix, sources):
    """A tensor-split layer's slots named `suffix`, gathered like its weights (or None)."""
    found = [sources.get(_slot_prefix(shard) + suffix) for shard in part.weights]
    if any(slot is None for slot in found):
        return None
    # `full_weights` gathers the shards' values: give it the slots' for a moment.
    kept = [shard.value.numpy() for shard in part.weights]
    try:
        for shard, slot in zip(part.weights, found):
            shard.assign(slot.value)
        return part.full_weights()
    finally:
        for shard, value in zip(part.weights, kept):
            shard.assign(value)


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
