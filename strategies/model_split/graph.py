"""Layer split of any functional graph: each part's calls run on its device, live tensors carried.

`graph_split` copies the user's functional model (`keras.models.clone_model`), each layer's
copy made and built on the device of its part (`_graph.plan`: a shared layer on that of its
first call), its state copied in. `SplitGraph` is that copy as a functional model (the
user's layers, names, inputs and outputs, so its weights files load into the user's model)
whose `call` runs the parts in turn, each part one hop (`on_device_many`) on its device: it
takes every tensor live across the cut before it, Keras masks included, and gives every
tensor live across the cut after it.
"""

import functools

import keras
import tensorflow as tf

from tfscale.compat.keras_mask import get_keras_mask, set_keras_mask
from tfscale.strategies import _graph
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._partition import BalanceError, graph_config
from tfscale.strategies._placement import clone_layer, copy_state, on_device_many
from tfscale.strategies.model_split.models import SplitFunctional

__all__ = ["SplitGraph", "flat_inputs", "graph_split", "run_calls"]


class _Recorded:
    """A call of the copied graph: the copy, its symbolic arguments and outputs."""

    def __init__(self, op, args, kwargs, outputs):
        self.op, self.args, self.kwargs, self.outputs = op, args, kwargs, outputs


class _Route:
    """What `SplitGraph.call` follows: the plan, the recorded calls, each symbolic tensor's key."""

    def __init__(self, the_plan, devices, recorded, keys):
        self.plan, self.devices, self.recorded, self.keys = the_plan, list(devices), recorded, keys


@keras.saving.register_keras_serializable(package="tfscale")
class SplitGraph(SplitFunctional):
    """A functional model whose parts run on their devices, each as one hop (see module doc).

    Loaded back from a file (no route), it runs as the functional model it is.
    """

    def call(self, inputs, training=None, mask=None):
        route = getattr(self, "_tfscale_route", None)
        if route is None:
            return super().call(inputs, training=training, mask=mask)
        keys = [route.keys[id(x)] for x in keras.tree.flatten(self.input)]
        env = dict(zip(keys, flat_inputs(self, inputs)))
        for part, device in enumerate(route.devices):
            takes, gives = route.plan.takes(part), route.plan.gives(part)
            run = functools.partial(run_calls, route, route.plan.calls[part], takes, gives, training=training)
            env.update(zip(gives, _hop(device, run, [env[key] for key in takes])))
        flat = [env[route.keys[id(y)]] for y in keras.tree.flatten(self.output)]
        outputs = keras.tree.pack_sequence_as(self.output, flat)
        if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
            return outputs[0]  # as Functional.call (`unpack_singleton`)
        return outputs


def flat_inputs(model, inputs):
    """The model's inputs as a flat list in `model.inputs` order, typed as Keras would."""
    specs = keras.tree.flatten(model.input)
    if isinstance(inputs, dict) and not isinstance(model.input, dict):
        inputs = [inputs[spec.name] for spec in specs]  # Keras matches a dict to input names
    values = keras.tree.flatten(inputs)
    if len(values) != len(specs):
        raise StrategyError(
            f"Model {model.name!r} expects {len(specs)} input(s) {[s.name for s in specs]}. "
            f"Received {len(values)}."
        )
    return [_conform(value, spec) for value, spec in zip(values, specs)]


def _conform(value, spec):
    """`value` as a tensor of `spec`'s dtype and rank (`Functional._adjust_input_rank`'s rule)."""
    mask = get_keras_mask(value) if tf.is_tensor(value) else None
    x = tf.convert_to_tensor(value)
    if x.dtype != spec.dtype:
        x = tf.cast(x, spec.dtype)
    rank = len(spec.shape)
    if x.shape.rank == rank + 1 and x.shape[-1] == 1:
        x = tf.squeeze(x, axis=-1)
    elif x.shape.rank == rank - 1 and spec.shape[-1] == 1:
        x = tf.expand_dims(x, axis=-1)
    if mask is not None:
        set_keras_mask(x, mask)
    return x


def _hop(device, run, values):
    """`run(values)` on `device`, each tensor's Keras mask carried in and out (no gradient)."""
    masks = [get_keras_mask(v) for v in values]
    present = [i for i, m in enumerate(masks) if m is not None]
    out_masks = []

    def fn(*xs):
        xs, given = list(xs[: len(values)]), xs[len(values) :]
        for i, m in zip(present, given):
            set_keras_mask(xs[i], m)
        ys = run(xs)
        out_masks.extend(get_keras_mask(y) for y in ys)
        return ys

    ys = on_device_many(device, fn, [*values, *(masks[i] for i in present)])
    for y, m in zip(ys, out_masks):
        if m is not None:
            set_keras_mask(y, m)
    return ys


def run_calls(route, calls, takes, gives, xs, *, training, on_call=None):
    """The calls of one part, in order, on its inputs; returns the tensors it gives.

    As `Functional.call`: a layer's recorded `training` (the default its symbolic call
    filled in) gives way to the model call's, when that is given. `on_call(op, inputs,
    outputs)`, if given, sees each call's operation and its input and output tensors.
    """
    local = dict(zip(takes, xs))

    def fill(value):
        return local[route.keys[id(value)]] if isinstance(value, keras.KerasTensor) else value

    for call in calls:
        recorded = route.recorded[(call.layer, call.node)]
        args = keras.tree.map_structure(fill, recorded.args)
        kwargs = keras.tree.map_structure(fill, recorded.kwargs)
        if training is not None and isinstance(recorded.op, keras.layers.Layer):
            kwargs["training"] = training
        outputs = recorded.op(*args, **kwargs)
        flat = keras.tree.flatten(outputs)
        for symbolic, value in zip(recorded.outputs, flat):
            local[route.keys[id(symbolic)]] = value
        if on_call is not None:
            on_call(recorded.op, [t for t in keras.tree.flatten((args, kwargs)) if tf.is_tensor(t)], flat)
    return [local[key] for key in gives]


def graph_split(model, devices, balance=None, name=None):
    """A `SplitGraph` copy of functional `model` over `devices`, its parts by `balance`.

    Returns:
        (split, placement): the split model and `_graph.describe`'s rows.

    Raises:
        BalanceError: the model cannot be cut (no graph, too few calls, invalid balance).
        StrategyError: a layer that cannot be copied.
    """
    the_plan = _graph.plan(model, len(devices), balance)
    home = {layer: devices[part] for layer, part in the_plan.home.items()}
    originals, keys, recorded = {}, {}, {}
    calls = {}
    for part in the_plan.calls:
        for call in part:
            calls.setdefault(call.layer, []).append(call)

    def make(op):
        # Under the device: Keras builds nested layers of a config as it deserializes them.
        with tf.device(home[op.name]):
            copy = clone_layer(op)
        originals[id(copy)] = op
        return copy

    def record(op, *args, **kwargs):
        layer = originals[id(op)].name
        given = sorted(
            keys[id(t)] for t in keras.tree.flatten((args, kwargs)) if isinstance(t, keras.KerasTensor)
        )
        call = next(
            (c for c in calls[layer] if (c.layer, c.node) not in recorded and sorted(c.inputs) == given),
            None,
        )
        if call is None:
            raise BalanceError(
                f"Cannot cut model {model.name!r} by layers: Keras calls {layer!r} on {given}, a call "
                "its config does not list. Expected the config to describe the graph: report it with "
                "the model's get_config()."
            )
        with tf.device(home[layer]):  # the first call builds the copy's variables there
            outputs = op(*args, **kwargs)
        flat = keras.tree.flatten(outputs)
        for index, symbolic in enumerate(flat):
            keys[id(symbolic)] = (call.layer, call.node, index)
        recorded[(call.layer, call.node)] = _Recorded(op, args, kwargs, flat)
        return outputs

    inputs = keras.tree.map_structure(
        lambda x: keras.Input(batch_shape=x.shape, dtype=x.dtype, name=x.name), model.input
    )
    for symbolic, key in zip(keras.tree.flatten(inputs), _input_keys(model), strict=True):
        keys[id(symbolic)] = key
    clone = keras.models.clone_model(model, input_tensors=inputs, clone_function=make, call_function=record)
    for copy in clone.layers:
        original = originals.get(id(copy))
        if original is not None and getattr(original, "variables", None):
            copy_state(original, copy)
    split = SplitGraph(clone.input, clone.output, name=name or f"{model.name}_split")
    made = {keys[id(y)] for y in keras.tree.flatten(split.output)}
    if made != set(the_plan.outputs):
        raise BalanceError(
            f"Cannot cut model {model.name!r} by layers: its config names outputs "
            f"{sorted(the_plan.outputs)}, its graph {sorted(made)}. Expected them equal (a Keras "
            "numbering this version does not know): report it with the model's get_config()."
        )
    # Untracked: Keras would track the recorded layers and tensors as the model's own.
    object.__setattr__(split, "_tfscale_route", _Route(the_plan, devices, recorded, keys))
    return split, _graph.describe(model, the_plan, devices)


def _input_keys(model):
    """The model's input tensors' keys, in `keras.tree.flatten(model.input)` order.

    By position in the config's `input_layers` (the same structure as `model.input`; an
    unnamed `keras.Input`'s tensor is not named as its layer), dict keys sorted as
    `keras.tree` sorts them.
    """

    def flat(spec):
        if isinstance(spec, dict):
            return [key for name in sorted(spec) for key in flat(spec[name])]
        if spec and isinstance(spec[0], str):
            return [tuple(spec)]
        return [key for value in spec for key in flat(value)]

    return flat(graph_config(model)["input_layers"])
