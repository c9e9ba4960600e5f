"""Rewriting a model's Dense / Embedding / MultiHeadAttention layers into their split forms."""

import keras
import tensorflow as tf

from tfscale.strategies._partition import graph_config, tensor_producers, tensor_specs
from tfscale.strategies._placement import clone_layer, copy_state
from tfscale.strategies._placement import model_input as _model_input
from tfscale.strategies.model_split.layers import (
    ColumnParallelDense,
    HeadParallelMultiHeadAttention,
    ModelSplitError,
    RowParallelDense,
    VocabParallelEmbedding,
    is_elementwise,
)
from tfscale.strategies.model_split.models import SplitFunctional, SplitSequential

__all__ = ["SUPPORTED", "model_input", "tensor_split"]

SUPPORTED = (keras.layers.Dense, keras.layers.Embedding, keras.layers.MultiHeadAttention)
# Config keys whose non-default value the split layers do not reproduce.
_MUST_BE_UNSET = (
    "kernel_regularizer",
    "bias_regularizer",
    "activity_regularizer",
    "embeddings_regularizer",
    "kernel_constraint",
    "bias_constraint",
    "embeddings_constraint",
    "lora_rank",
    "quantization_config",
    "sliding_window",
    "flash_attention",
    "use_gate",
)


class _Shards:
    """K activation shards travelling as one graph value between a column and a row layer.

    `keras.models.clone_model` maps each original output tensor to one new value; a plain
    list would be flattened into K outputs, so the list travels wrapped (a tree leaf).
    """

    def __init__(self, tensors):
        self.tensors = tensors


def model_input(model):
    """A fresh `keras.Input` like the model's single input; the model must be built."""
    inputs = _model_input(model)
    if inputs is None:
        raise ModelSplitError(
            f"Cannot split model {model.name!r}: it is not built, so its input shape is unknown. "
            "Start it with keras.Input(...) or call model.build(input_shape) first."
        )
    return inputs


def copy_weights(source_layers, target):
    """Copies each source layer's state into `target`'s layer of the same name.

    Split layers take the unsplit weights; the others all their state (`copy_state`).
    """
    for layer in source_layers:
        if not layer.variables:  # e.g. the InputLayer, whose copy gets a fresh name.
            continue
        new = target.get_layer(layer.name)
        if hasattr(new, "set_full_weights"):
            new.set_full_weights(layer.get_weights())
        else:
            copy_state(layer, new)


def _candidates(model, tensor_layers):
    """The layers to consider, and whether the user forced them (`tensor_layers=`)."""
    if tensor_layers is None:
        return [layer for layer in model.layers if type(layer) in SUPPORTED], False
    targets = []
    for name in tensor_layers:
        try:
            layer = model.get_layer(name)
        except ValueError:
            raise ModelSplitError(
                f"Invalid value for argument `tensor_layers`: model {model.name!r} has no layer "
                f"{name!r}. Expected names among {[layer.name for layer in model.layers]}."
            ) from None
        if not isinstance(layer, SUPPORTED):
            raise ModelSplitError(
                f"Cannot tensor-split layer {name!r}: its type {type(layer).__name__} has no split "
                f"form. Expected one of {[cls.__name__ for cls in SUPPORTED]}."
            )
        targets.append(layer)
    return targets, True


def _why_whole(layer, k):
    """Why `layer` cannot be split `k` ways (one sentence), or None when it can."""
    config = layer.get_config()
    for key in _MUST_BE_UNSET:
        if config.get(key) not in (None, False, 0):
            return f"option `{key}={config[key]!r}` has no split form"
    axes = config.get("attention_axes")
    if axes is not None and tuple(axes) != (1,):  # (1,) is what Keras sets for (batch, seq, features).
        return f"`attention_axes={axes!r}`; only attention over the sequence axis splits"
    if isinstance(layer, keras.layers.MultiHeadAttention):
        shape = config.get("output_shape")
        if not (shape is None or isinstance(shape, int)):
            return f"`output_shape={shape!r}`; only None or an int splits"
        sizes = {"`num_heads`": config["num_heads"], "output features": layer.weights[-1].shape[-1]}
    elif isinstance(layer, keras.layers.Embedding):
        sizes = {"`input_dim` (vocabulary size)": config["input_dim"]}
    else:
        sizes = {"`units`": config["units"]}
    for what, size in sizes.items():
        if size % k:
            return f"its {what} is {size}, not divisible by {k}"
    return None


def _choose(model, tensor_layers, k):
    """The layers to split, and {name: reason} for the candidates left whole.

    Without `tensor_layers`, a layer that cannot be split is left whole (and said so in
    `report()`); a layer the user named must split, or the split is refused.
    """
    candidates, forced = _candidates(model, tensor_layers)
    targets, whole = [], {}
    for layer in candidates:
        reason = _why_whole(layer, k)
        if reason is None:
            targets.append(layer)
        elif forced:
            raise ModelSplitError(
                f"Cannot tensor-split layer {layer.name!r} ({type(layer).__name__}) {k} ways: "
                f"{reason}. Expected it left out of `tensor_layers`."
            )
        else:
            whole[layer.name] = reason
    return targets, whole


def _pairs(model, targets):
    """Column -> row pairs: Dense a whose only consumer is Dense b, b's only input being a.

    a's activation must be elementwise: its shards are activated apart, never gathered.
    """
    dense = {layer.name for layer in targets if isinstance(layer, keras.layers.Dense)}
    elementwise = {name for name in dense if is_elementwise(model.get_layer(name).activation)}
    links = _links(model)
    firsts, seconds = set(), set()
    for a, b in links:
        if a in elementwise and b in dense and a not in seconds and a not in firsts and b not in firsts:
            firsts.add(a)
            seconds.add(b)
    return firsts, seconds


def _links(model):
    """(producer, consumer) for every edge where each is the other's only partner."""
    if isinstance(model, keras.Sequential):
        names = [layer.name for layer in model.layers]
        return list(zip(names, names[1:]))
    config = graph_config(model)
    inputs, consumers = {}, {}
    for entry in config["layers"]:
        producers = [p for node in entry["inbound_nodes"] for p in tensor_producers(node)]
        inputs[entry["name"]] = producers
        for p in producers:
            consumers.setdefault(p, []).append(entry["name"])
    outputs = {spec[0] for spec in tensor_specs(config["output_layers"])}
    return [
        (p, c[0]) for p, c in consumers.items() if len(c) == 1 and inputs[c[0]] == [p] and p not in outputs
    ]


def _split_form(layer, devices, role):
    config = layer.get_config()
    # `trainable` too: a frozen (pretrained) layer stays frozen once split.
    common = {"name": layer.name, "dtype": layer.dtype_policy, "trainable": layer.trainable}
    if isinstance(layer, keras.layers.Dense):
        dense = {k: config[k] for k in ("use_bias", "kernel_initializer", "bias_initializer")}
        # The function itself: a custom one need not be registered to be found again.
        dense["activation"] = layer.activation
        if role == "row":
            return RowParallelDense(config["units"], devices, input_is_parallel=True, **dense, **common)
        return ColumnParallelDense(
            config["units"], devices, gather_output=role != "column", **dense, **common
        )
    if isinstance(layer, keras.layers.Embedding):
        return VocabParallelEmbedding(
            config["input_dim"],
            config["output_dim"],
            devices,
            embeddings_initializer=config["embeddings_initializer"],
            mask_zero=config["mask_zero"],
            **common,
        )
    keys = (
        "value_dim",
        "dropout",
        "use_bias",
        "output_shape",
        "kernel_initializer",
        "bias_initializer",
        "seed",
    )
    return HeadParallelMultiHeadAttention(
        config["num_heads"], config["key_dim"], devices, **{k: config[k] for k in keys}, **common
    )


def _call(layer, *args, **kwargs):
    args = [a.tensors if isinstance(a, _Shards) else a for a in args]
    outputs = layer(*args, **kwargs)
    if isinstance(layer, ColumnParallelDense) and not layer.gather_output:
        return _Shards(outputs)
    return outputs


def tensor_split(model, devices, tensor_layers=None):
    """A copy of `model` with its eligible layers split over `devices`, weights preserved.

    Layers not split are copies of the user's (class, config, weights, seed states) on
    `devices[0]`; without `tensor_layers`, that includes every Dense / Embedding /
    MultiHeadAttention that cannot be split exactly (see `_why_whole`).

    Returns:
        (split, whole): the split model, and {layer name: why it was left whole} for the
        layers with weights that were not split.

    Raises:
        ModelSplitError: a named layer is missing, of an unsupported type, uses an option
            with no split form or has a dimension not divisible by `len(devices)`; or no
            layer of the model can be split.
    """
    targets, whole = _choose(model, tensor_layers, len(devices))
    if not targets:
        reasons = "; ".join(f"{name!r}: {why}" for name, why in whole.items())
        raise ModelSplitError(
            f"Model {model.name!r} has no layer to tensor-split {len(devices)} ways: expected at "
            f"least one of {[cls.__name__ for cls in SUPPORTED]} among its top-level layers"
            + (f" that can be split ({reasons})." if reasons else ".")
        )
    firsts, seconds = _pairs(model, targets)
    roles = {
        t.name: "column" if t.name in firsts else "row" if t.name in seconds else "gather" for t in targets
    }

    def make(layer):
        if layer.name in roles:
            return _split_form(layer, devices, roles[layer.name])
        return clone_layer(layer)

    with tf.device(devices[0]):
        if isinstance(model, keras.Sequential):
            layers = [model_input(model)] + [make(layer) for layer in model.layers]
            split = SplitSequential(layers, name=f"{model.name}_split")
        else:
            clone = keras.models.clone_model(model, clone_function=make, call_function=_call)
            # `input` / `output`: the user's structures (a dict of outputs stays a dict, so
            # `loss` and `loss_weights` given by output name still find their outputs).
            split = SplitFunctional(clone.input, clone.output, name=f"{model.name}_split")
    copy_weights(model.layers, split)
    for layer in model.layers:
        if layer.weights and layer.name not in roles:
            whole.setdefault(layer.name, f"{type(layer).__name__} has no split form")
    return split, whole
