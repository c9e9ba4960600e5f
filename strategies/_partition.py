"""Partitioning a Keras model into consecutive parts: the chain of layers, the balance, the report.

Shared by the pipeline strategy and the model-split strategy (one partitioner, not two). The
balance methods follow torchgpipe's `balance/` (by time) and DeepSpeed's pipeline partitioner
(by parameters, its default): contiguous parts, the largest part as small as possible.

Tolerance of the "parameters" method: the largest part holds at most
`total / num_parts + largest single layer` parameters (the classic bound for contiguous
partitions; the optimum is found exactly, so it is often much closer to `total / num_parts`).
"""

import time

import numpy as np

from tfscale import _strategy_spec as _spec
from tfscale.strategies._errors import StrategyError

__all__ = [
    "BalanceError",
    "balance",
    "chain_layers",
    "describe",
    "graph_config",
    "is_chain",
    "layer_bytes",
    "layer_params",
    "partition",
    "tensor_histories",
    "tensor_producers",
    "tensor_specs",
]

# A layer without parameters (activation, dropout, reshape) weighs this fraction of a parameter,
# so that it still counts in the tie-break instead of piling up in one part.
_EPSILON = 1e-3
_TIME_REPEATS = 3
# Said by every refusal of a graph that is not a chain: the layer split cuts any graph.
_GRAPH_HINT = " The layer split (strategies.get('model_split')) takes any functional graph as it is."


class BalanceError(StrategyError):
    """A model that cannot be cut as asked; the message carries the numbers and a fix."""


def chain_layers(model):
    """Returns the model as a straight chain of layers, in call order.

    A `keras.Sequential` gives its layers. A functional model gives its layers in
    topological order, but only if each layer takes exactly the previous layer's single
    output, and that output feeds nothing else.

    Args:
        model: a built or unbuilt `keras.Sequential`, or a functional `keras.Model`.

    Returns:
        A list of `keras.layers.Layer` (input layers excluded).

    Raises:
        BalanceError: the model is subclassed, has several inputs or outputs, or a layer
            branches or merges (skip connections); the message names the first such layer.
    """
    import keras

    config = None if isinstance(model, keras.Sequential) else graph_config(model)
    if isinstance(model, keras.Sequential):
        layers = list(model.layers)
    elif config is not None:
        layers = _functional_chain(model, config)
    else:
        raise BalanceError(
            f"Cannot cut model {model.name!r} of class {type(model).__name__} into parts: only "
            "keras.Sequential and functional models have a known layer order. Rebuild it as a "
            "Sequential of blocks (each block a Layer)."
        )
    if not layers:
        raise BalanceError(f"Model {model.name!r} has no layers to cut into parts.")
    return layers


def is_chain(model):
    """Whether `model` is a Sequential or a functional chain (`chain_layers` takes it)."""
    try:
        chain_layers(model)
    except BalanceError:
        return False
    return True


def graph_config(model):
    """The functional graph's config, or None for a subclassed model (which has no graph)."""
    try:
        config = model.get_config()
    except NotImplementedError:
        return None
    if isinstance(config, dict) and "layers" in config and "input_layers" in config:
        return config
    return None


def tensor_histories(node):
    """The `keras_history` (layer, node, tensor) of every tensor argument of a serialized node,
    in argument order; constants are skipped."""
    return [tuple(spec["keras_history"]) for spec in tensor_configs(node)]


def tensor_configs(node):
    """The config (shape, dtype, keras_history) of every tensor argument of a serialized node."""
    found = []

    def visit(value):
        if isinstance(value, dict) and value.get("class_name") == "__keras_tensor__":
            found.append(value["config"])
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    visit(node.get("args", []))
    visit(node.get("kwargs", {}))
    return found


def tensor_producers(node):
    """The producing layer names of every tensor argument of a serialized node."""
    return [history[0] for history in tensor_histories(node)]


def _functional_chain(model, config):
    # The serialized config is the public description of the graph: each layer lists the
    # producers of its inputs (`keras_history`), in topological order.
    inputs, outputs = config["input_layers"], config["output_layers"]
    if _count_tensors(inputs) != 1 or _count_tensors(outputs) != 1:
        raise BalanceError(
            f"Cannot cut model {model.name!r} into a chain: it has {_count_tensors(inputs)} "
            f"input(s) and {_count_tensors(outputs)} output(s); a chain has one of each.{_GRAPH_HINT}"
        )
    consumers = {}
    for entry in config["layers"]:
        for node in entry["inbound_nodes"]:
            for producer in tensor_producers(node):
                consumers.setdefault(producer, []).append(entry["name"])
    previous, layers = None, []
    for entry in config["layers"]:
        name = entry["name"]
        if entry["class_name"] == "InputLayer":
            previous = name
            continue
        _check_link(model, entry, previous, consumers)
        layers.append(_layer(model, entry))
        previous = name
    return layers


def _layer(model, entry):
    """The layer of a graph entry; a raw `keras.ops` call in the graph is not one."""
    try:
        return model.get_layer(entry["name"])
    except ValueError:
        raise BalanceError(
            f"Cannot cut model {model.name!r} into a chain at {entry['name']!r}: it is a raw "
            f"keras.ops call ({entry['class_name']}), not a Layer, so it cannot be placed on a "
            "device. Wrap it in a Layer (keras.layers.Activation for an activation, or a custom "
            f"Layer whose call() makes it).{_GRAPH_HINT}"
        ) from None


def _count_tensors(spec):
    return len(tensor_specs(spec))


def tensor_specs(spec):
    """The [layer name, node, tensor] entries of a config's `input_layers` / `output_layers`:
    one entry, or a list or dict (outputs by name) of entries."""
    if isinstance(spec, dict):
        return [entry for value in spec.values() for entry in tensor_specs(value)]
    if spec and isinstance(spec[0], str):
        return [spec]
    return [entry for value in spec for entry in tensor_specs(value)]


def _check_link(model, entry, previous, consumers):
    name = entry["name"]
    nodes = entry["inbound_nodes"]
    if len(nodes) != 1:
        raise BalanceError(
            f"Cannot cut model {model.name!r} into a chain at layer {name!r}: it is called "
            f"{len(nodes)} times (shared layer). Use a separate layer per call.{_GRAPH_HINT}"
        )
    producers = tensor_producers(nodes[0])
    if producers != [previous]:
        raise BalanceError(
            f"Cannot cut model {model.name!r} into a chain at layer {name!r}: it takes "
            f"{len(producers)} input(s) from {producers}, expected the single output of "
            f"{previous!r} (skip connections and merges cannot be cut). Wrap the branching "
            f"part in one Layer (a block) so the model becomes a chain of blocks.{_GRAPH_HINT}"
        )
    if len(consumers.get(previous, [])) > 1:
        raise BalanceError(
            f"Cannot cut model {model.name!r} into a chain at layer {previous!r}: its output "
            f"feeds {len(consumers[previous])} layers {consumers[previous]} (a branch). Wrap "
            "the branching part in one Layer (a block) so the model becomes a chain of blocks."
            f"{_GRAPH_HINT}"
        )


def layer_params(layer):
    """Number of scalars in the layer's weights (trainable and not)."""
    return int(sum(int(np.prod(w.shape)) for w in layer.weights))


def layer_bytes(layer):
    """Bytes of the layer's weights, from each weight's shape and dtype."""
    return int(sum(int(np.prod(w.shape)) * np.dtype(w.dtype).itemsize for w in layer.weights))


def balance(layers, num_parts, method=None, sample_input=None, cut_costs=None):
    """Cuts a chain of layers into `num_parts` consecutive parts.

    Args:
        layers: the chain, e.g. from `chain_layers(model)`.
        num_parts: how many parts (devices or pipeline stages), >= 1.
        method: one of `tfscale._strategy_spec.BALANCE_METHODS`, None for the default of
            the strategies' `balance` option (the spec's): "parameters" (the largest part's parameter
            count as small as possible, layers without parameters weigh a small epsilon),
            "uniform" (by layer count), "time" (by each layer's measured forward + backward
            time on `sample_input`), or an explicit list of layer counts per part.
        sample_input: a batch for the first layer; needed by "time" only.
        cut_costs: optional, per position i (1 .. len(layers) - 1) the cost of a cut before
            layer i (a graph's bytes crossing it); among the partitions whose largest part is
            minimal, the cheapest cuts are taken (`partition`). Not used by an explicit list.

    Returns:
        A list of `num_parts` positive ints, the number of consecutive layers in each part,
        summing to `len(layers)`.

    Raises:
        BalanceError: `num_parts` is not a positive int or exceeds the number of layers, an
            unknown method, an invalid explicit list, or "parameters" on unbuilt layers.
    """
    layers = list(layers)
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise BalanceError(
            f"Invalid value for argument `num_parts`. Received: num_parts={num_parts!r}. "
            "Expected a positive integer."
        )
    if num_parts > len(layers):
        raise BalanceError(
            f"too few layers to make {num_parts} parts (layers: {len(layers)}, parts: "
            f"{num_parts}). Use at most {len(layers)} parts, or split the model into more layers."
        )
    if method is None:
        method = _spec.ModelSplitOptions.balance  # PipelineOptions.balance is the same
    if isinstance(method, (list, tuple)):
        return _check_explicit(list(method), len(layers), num_parts)
    if method == "uniform":
        weights = [1.0] * len(layers)
    elif method == "parameters":
        weights = _param_weights(layers)
    elif method == "time":
        weights = _time_weights(layers, sample_input)
    else:
        raise BalanceError(
            f"Invalid value for argument `balance`. Received: balance={method!r}. Expected one "
            f"of {list(_spec.BALANCE_METHODS)} or a list of layer counts per part."
        )
    return partition(weights, num_parts, cut_costs)


def _check_explicit(counts, num_layers, num_parts):
    valid = (
        len(counts) == num_parts
        and all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in counts)
        and sum(counts) == num_layers
    )
    if not valid:
        raise BalanceError(
            f"Invalid value for argument `balance`. Received: balance={counts!r}. Expected "
            f"{num_parts} positive layer counts summing to {num_layers} (the number of layers)."
        )
    return counts


def _param_weights(layers):
    unbuilt = [layer.name for layer in layers if not layer.built]
    if unbuilt:
        raise BalanceError(
            f"Cannot balance by parameters: layer {unbuilt[0]!r} is not built, so it has no "
            "parameters yet. Build the model first (keras.Input, or model.build(input_shape)), "
            "or use balance='uniform'."
        )
    return [float(layer_params(layer)) or _EPSILON for layer in layers]


def _time_weights(layers, sample_input):
    import tensorflow as tf

    if sample_input is None:
        raise BalanceError(
            "Invalid value for argument `sample_input`. Received: sample_input=None. Expected a "
            "batch for the first layer: balance='time' measures each layer on it."
        )
    weights, x = [], tf.convert_to_tensor(sample_input)
    for layer in layers:
        x, seconds = _time_layer(layer, x)
        weights.append(max(seconds, 1e-9))
    return weights


def _time_layer(layer, x):
    import tensorflow as tf

    timings = []
    for _ in range(_TIME_REPEATS + 1):
        start = time.perf_counter()
        with tf.GradientTape() as tape:
            if x.dtype.is_floating:
                tape.watch(x)
            y = layer(x)
        sources = list(layer.trainable_variables) + ([x] if x.dtype.is_floating else [])
        if sources:
            tape.gradient(y, sources)
        timings.append(time.perf_counter() - start)
    # The first call builds the layer and warms up; the fastest of the rest is the least noisy.
    return y, min(timings[1:])


def partition(weights, num_parts, cut_costs=None):
    """Contiguous partition minimising the largest part's weight (exact), then evening out.

    Among the partitions whose largest part is minimal (with `cut_costs`: up to the items of
    no weight, which may join either side of a cut), the one with the smallest sum of
    `cut_costs` at its cuts is returned (none given: all cuts cost the same), then, of those,
    the one with the smallest sum of squared part weights, so that the smaller parts are as
    even as they can be.

    Args:
        weights: a non-negative weight per item.
        num_parts: 1 <= num_parts <= len(weights).
        cut_costs: optional, `cut_costs[i]` the cost of a cut before item i (index 0 unused).

    Returns:
        The number of items in each part.
    """
    n = len(weights)
    prefix = np.concatenate([[0.0], np.cumsum(weights, dtype=np.float64)])
    cap = _min_max_part(prefix, n, num_parts) * (1 + 1e-9)
    if cut_costs is not None:
        # Items of no weight (a merge, an activation, a raw op: `_EPSILON`) may join either
        # neighbour, the largest part's too, so that the cut can move to where less crosses.
        cap += sum(w for w in weights if w <= _EPSILON)
    inf = float("inf")
    costs = [0.0] * (n + 1) if cut_costs is None else [*cut_costs, 0.0][: n + 1]
    # cost[j][i]: (least sum of cut costs, then of squares) of j parts covering the first i
    # items, each <= cap; a part's cut cost is that of its start (none for the first).
    cost = np.full((num_parts + 1, n + 1, 2), inf)
    cut = np.zeros((num_parts + 1, n + 1), dtype=int)
    cost[0][0] = (0.0, 0.0)
    for j in range(1, num_parts + 1):
        for i in range(j, n - (num_parts - j) + 1):
            for k in range(j - 1, i):
                part = prefix[i] - prefix[k]
                if part > cap or cost[j - 1][k][0] == inf:
                    continue
                total = (cost[j - 1][k][0] + (costs[k] if k else 0.0), cost[j - 1][k][1] + part * part)
                if tuple(total) < tuple(cost[j][i]):
                    cost[j][i], cut[j][i] = total, k
    counts, i = [], n
    for j in range(num_parts, 0, -1):
        counts.append(i - cut[j][i])
        i = cut[j][i]
    return counts[::-1]


def _min_max_part(prefix, n, num_parts):
    """The smallest achievable largest-part weight (exact DP over contiguous cuts)."""
    inf = float("inf")
    best = np.full((num_parts + 1, n + 1), inf)
    best[0][0] = 0.0
    for j in range(1, num_parts + 1):
        for i in range(j, n - (num_parts - j) + 1):
            best[j][i] = min(max(best[j - 1][k], prefix[i] - prefix[k]) for k in range(j - 1, i))
    return best[num_parts][n]


def describe(layers, counts, devices):
    """Per part: its device, layer names, parameter count and parameter bytes.

    Args:
        layers: the chain of layers.
        counts: layers per part, e.g. from `balance`.
        devices: one device name per part.

    Returns:
        A list of dicts with keys "device", "layers", "params", "param_bytes".
    """
    if len(counts) != len(devices) or sum(counts) != len(layers):
        raise BalanceError(
            f"Invalid parts: {len(counts)} part(s) of {sum(counts)} layers for {len(devices)} "
            f"device(s) and {len(layers)} layers. Expected one device per part, all layers used."
        )
    report, start = [], 0
    for count, device in zip(counts, devices):
        part = layers[start : start + count]
        start += count
        report.append(
            {
                "device": device,
                "layers": [layer.name for layer in part],
                "params": sum(layer_params(layer) for layer in part),
                "param_bytes": sum(layer_bytes(layer) for layer in part),
            }
        )
    return report
