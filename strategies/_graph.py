"""Partitioning a functional graph: its calls in topological order, and what crosses each cut.

The layer split cuts any Keras functional graph (branches, skip connections, several inputs
and outputs, shared layers, raw `keras.ops` calls) as PyTorch's pipelining cuts a traced
program: the graph's calls, in a topological order, are cut into consecutive parts by the
balance rules of `_partition`, and each cut carries every tensor live across it (made
before it, used after it), so a skip connection passes through the parts it spans.

Everything is read from the model's config, the public description of the graph: a call
is one inbound node of a layer (a shared layer has several), its inputs the
`keras_history` of its tensor arguments. TensorFlow-free.
"""

import collections
import dataclasses

from tfscale.strategies._partition import (
    BalanceError,
    balance,
    graph_config,
    layer_bytes,
    layer_params,
    tensor_configs,
    tensor_histories,
    tensor_specs,
)

__all__ = ["Call", "Plan", "calls_of", "carried_bytes", "describe", "plan", "tensor_label"]


@dataclasses.dataclass(frozen=True)
class Call:
    """One call of a layer (or raw op) in the graph: its node index and input tensors.

    A tensor is named by its producer's coordinates `(layer name, node index, tensor
    index)`, as the config's `keras_history` names it.
    """

    layer: str
    node: int
    inputs: tuple

    @property
    def label(self):
        return self.layer if self.node == 0 else f"{self.layer}#{self.node}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The parts of a graph: per part its calls, the tensors it takes and gives; per layer its part.

    `carried[c]` are the tensors live across cut c (between parts c and c + 1); part p
    takes `carried[p - 1]` (the model's inputs for p = 0) and gives `carried[p]` (the
    model's outputs for the last part). `home[layer]` is the part its variables live in:
    that of its first call (a shared layer is placed once).
    """

    calls: tuple  # per part, its Calls in order
    inputs: tuple  # the model's input tensors
    outputs: tuple  # the model's output tensors
    carried: tuple  # per cut, the tensors crossing it
    home: dict
    carried_bytes: tuple = ()  # per cut, the bytes per sample of the tensors crossing it

    def takes(self, part):
        return self.inputs if part == 0 else self.carried[part - 1]

    def gives(self, part):
        return self.outputs if part == len(self.calls) - 1 else self.carried[part]


def tensor_label(key):
    """`dense:0`, `shared#1:0`: the producing call and the tensor's index among its outputs."""
    layer, node, index = key
    return f"{layer if node == 0 else f'{layer}#{node}'}:{index}"


def calls_of(model):
    """The calls of a functional `model`'s graph in a topological order (config order when free).

    Raises:
        BalanceError: `model` has no graph (a subclassed model: its `call` is Python).
    """
    config = graph_config(model)
    if config is None:
        raise BalanceError(
            f"Cannot cut model {model.name!r} of class {type(model).__name__} by layers: its call() is "
            "Python, not a Keras graph, so what runs after what is unknown. Build it as a functional "
            "model (keras.Input ... keras.Model(inputs, outputs)) or a Sequential, or split it with "
            "tensor_parallel."
        )
    pending = [
        Call(entry["name"], k, tuple(tensor_histories(node)))
        for entry in config["layers"]
        if entry["class_name"] != "InputLayer"
        for k, node in enumerate(entry["inbound_nodes"])
    ]
    made = {tuple(key[:2]) for key in tensor_specs(config["input_layers"])}
    order = []
    while pending:
        ready = next((i for i, c in enumerate(pending) if all(key[:2] in made for key in c.inputs)), None)
        if ready is None:
            raise BalanceError(
                f"Cannot cut model {model.name!r} by layers: call {pending[0].label!r} takes a tensor "
                f"its graph never makes ({pending[0].inputs}). Expected a functional model whose "
                "layers take the model's inputs or other layers' outputs."
            )
        call = pending.pop(ready)
        order.append(call)
        made.add((call.layer, call.node))
    if not order:
        raise BalanceError(f"Model {model.name!r} has no layers to cut into parts.")
    return order, config


def _output_keys(config):
    """The model's output tensors as `(layer, node, tensor)` in the call's numbering.

    Keras numbers a nested functional model's nodes from 1 in `output_layers` (its node 0
    links its own inputs) but from 0 in its callers' `keras_history`: the latter is used.
    """
    classes = {entry["name"]: entry["class_name"] for entry in config["layers"]}
    keys = []
    for layer, node, index in tensor_specs(config["output_layers"]):
        offset = 1 if classes.get(layer) == "Functional" and node > 0 else 0
        keys.append((layer, node - offset, index))
    return tuple(keys)


def carried_bytes(calls, config):
    """Per position i of `calls`, the bytes per sample of the tensors a cut before call i carries.

    Every tensor made before call i (the model's inputs included) and used by call i or a
    later one, or a model output, crosses that cut. A tensor's size is read from the config
    (its shape past the batch and its dtype where a call takes it); a model output no call
    takes counts 0 (its shape is not in the config).
    """
    sizes = tensor_sizes(config)
    position = {(c.layer, c.node): i for i, c in enumerate(calls)}
    last = {}
    for i, call in enumerate(calls):
        for key in call.inputs:
            last[key] = max(last.get(key, i), i)
    for key in _output_keys(config):
        last[key] = len(calls)
    costs = [0.0] * len(calls)
    for key, end in last.items():
        start = position.get(tuple(key[:2]), -1) + 1  # the first cut it crosses is before `start`
        for i in range(max(start, 1), min(end, len(calls) - 1) + 1):
            costs[i] += sizes.get(key, 0)
    return costs


def tensor_sizes(config):
    """{tensor key: bytes per sample}, for every tensor a call of the graph takes."""
    sizes = {}
    for entry in config["layers"]:
        for node in entry["inbound_nodes"]:
            for spec in tensor_configs(node):
                sizes[tuple(spec["keras_history"])] = _sample_bytes(spec.get("shape"), spec.get("dtype"))
    return sizes


_DTYPE_BYTES = {"float64": 8, "int64": 8, "float32": 4, "int32": 4, "float16": 2, "bfloat16": 2, "bool": 1}


def _sample_bytes(shape, dtype):
    """Bytes of one sample of a tensor of `shape` (batch first; unknown dimensions count 1)."""
    count = 1
    for d in list(shape or [])[1:]:
        count *= d if isinstance(d, int) and d > 0 else 1
    return float(count * _DTYPE_BYTES.get(str(dtype), 4))


class _Unit(collections.namedtuple("_Unit", ["name", "built", "weights"])):
    """A call as `_partition.balance` weighs a layer: a shared layer's weights on its first call."""


def _units(model, calls):
    operations = {op.name: op for op in model.operations}
    seen, units = set(), []
    for call in calls:
        op = operations[call.layer]
        first = call.layer not in seen
        seen.add(call.layer)
        weights = list(getattr(op, "weights", [])) if first else []
        units.append(_Unit(call.label, getattr(op, "built", True), weights))
    return units


def plan(model, num_parts, method=None):
    """Cuts the graph of a functional `model` into `num_parts` parts of consecutive calls.

    Args:
        model: a built functional `keras.Model`.
        num_parts: how many parts (devices).
        method: the `balance` option: "parameters", "uniform", or a list of call counts per
            part (a shared layer counts once per call; its parameters weigh on its first).

    Returns:
        A `Plan`.

    Raises:
        BalanceError: a subclassed model, too few calls, an invalid balance, or "time"
            (it measures a chain layer by layer).
    """
    if method == "time":
        raise BalanceError(
            f"Invalid value for argument `balance`. Received: balance='time' for model {model.name!r}, "
            "which is a graph, not a chain (time is measured layer by layer along a chain). Expected "
            "'parameters', 'uniform' or a list of call counts per device."
        )
    calls, config = calls_of(model)
    # Of the cuts that balance equally well, those carrying the fewest bytes (a tensor live
    # across two cuts costs at both): the stages' transfers and the activations they hold.
    counts = balance(_units(model, calls), num_parts, method, cut_costs=carried_bytes(calls, config))
    parts, start = [], 0
    for count in counts:
        parts.append(tuple(calls[start : start + count]))
        start += count
    part_of = {(c.layer, c.node): p for p, part in enumerate(parts) for c in part}
    inputs = tuple(tuple(key) for key in tensor_specs(config["input_layers"]))
    outputs = _output_keys(config)
    # A tensor is live across cut c when it is made in part <= c and used in a part > c.
    made = {key: -1 for key in inputs}
    last = {key: num_parts for key in outputs}  # the outputs leave after the last part
    for p, part in enumerate(parts):
        for call in part:
            for key in call.inputs:
                last[key] = max(last.get(key, p), p)
    for key in last:
        made.setdefault(key, part_of.get(key[:2], -1))
    position = {(c.layer, c.node): i for i, c in enumerate(calls)}
    position.update({key[:2]: i - len(inputs) for i, key in enumerate(inputs)})
    live = sorted(last, key=lambda key: (position.get(key[:2], -1), key[2]))  # in the order made
    carried = tuple(tuple(key for key in live if made[key] <= c < last[key]) for c in range(num_parts - 1))
    home = {}
    for p, part in enumerate(parts):
        for call in part:
            home.setdefault(call.layer, p)
    sizes = tensor_sizes(config)
    carried_sizes = tuple(sum(sizes.get(key, 0.0) for key in keys) for keys in carried)
    return Plan(tuple(parts), inputs, outputs, carried, home, carried_sizes)


def describe(model, the_plan, devices):
    """Per part: its device, the layers placed there, their parameters, and what crosses its cuts.

    Returns:
        A list of dicts with keys "device", "layers" (the layers placed there: their
        variables live there; raw ops are only in "calls"), "params", "param_bytes",
        "calls" (the calls it runs, `name#k` for the k-th call of a shared layer),
        "takes" and "gives" (the tensors crossing its cuts, as `tensor_label`s: every
        live tensor, the skips passing through included), "gives_bytes" (the bytes per
        sample of what it gives the next part; None for the last), and "shared" ({layer: device
        it lives on} for calls of a layer placed on another part).
    """
    operations = {op.name: op for op in model.operations}
    rows = []
    for p, (part, device) in enumerate(zip(the_plan.calls, devices)):
        firsts = [c.layer for c in part if the_plan.home[c.layer] == p and c.node == _first(the_plan, c)]
        # Layers only: a raw keras.ops call holds nothing (it is listed in "calls").
        layers = [operations[name] for name in firsts if hasattr(operations[name], "weights")]
        rows.append(
            {
                "device": device,
                "layers": [layer.name for layer in layers],
                "params": sum(layer_params(layer) for layer in layers),
                "param_bytes": sum(layer_bytes(layer) for layer in layers),
                "calls": [c.label for c in part],
                "takes": [tensor_label(key) for key in the_plan.takes(p)],
                "gives": [tensor_label(key) for key in the_plan.gives(p)],
                # Per sample: the bytes a micro-batch of n rows sends over this cut are n x this.
                "gives_bytes": int(the_plan.carried_bytes[p]) if p < len(the_plan.carried_bytes) else None,
                "shared": {
                    c.layer: devices[the_plan.home[c.layer]] for c in part if the_plan.home[c.layer] != p
                },
            }
        )
    return rows


def _first(the_plan, call):
    """The node index of `call.layer`'s first call in the plan's order."""
    return next(c.node for part in the_plan.calls for c in part if c.layer == call.layer)
