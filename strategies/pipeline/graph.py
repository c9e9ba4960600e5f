"""Pipeline stages of any functional graph: each stage runs its calls, every live tensor carried.

`graph_stages` copies the user's functional model with `model_split.graph.graph_split`
over the S x V stage devices: the graph's calls in topological order, cut by the balance
rules, every tensor live across a cut carried over it (`_graph.plan`), each layer's copy
built on its stage's device. A `GraphStage` takes the list of tensors crossing the cut
before it (the first stage: the model's inputs, flat) and gives the list crossing the cut
after it (the last: the model's outputs, in their structure), so the schedules run it as
they run a chain's stage (`step`: a chain's stage takes and gives one tensor).

A layer called more than once (a shared layer) must have every call in one stage: its
variables live on one device, and a stage's backward gives the gradients of its own
variables only. A split backward (W ops) takes each such call's weight gradient with the
call's inputs held fixed, so that the calls' parts add up to the layer's gradient.
"""

import keras

from tfscale.strategies._partition import BalanceError
from tfscale.strategies.model_split.graph import graph_split, run_calls
from tfscale.strategies.pipeline.step import Stage, Unit, _recomputed, _refuse_added_losses, _regularized

__all__ = ["GraphStage", "graph_stages"]


class GraphStage(Stage):
    """One stage of a graph's pipeline: its calls of the copied graph, on its device."""

    def __init__(self, index, route, device, recompute, serial, *, takes, gives, structure=None):
        calls = route.plan.calls[index]
        ops = []
        for call in calls:
            op = route.recorded[(call.layer, call.node)].op
            if not any(op is seen for seen in ops):
                ops.append(op)
        layers = [op for op in ops if isinstance(op, keras.layers.Layer)]
        super().__init__(index, layers, device, recompute, serial)
        self.route, self.calls = route, calls
        self.takes, self.gives = list(takes), list(gives)
        self.structure = structure  # the last stage packs the model's outputs in it
        counts = {}
        for call in calls:
            counts[call.layer] = counts.get(call.layer, 0) + 1
        self._shared = {name for name, count in counts.items() if count > 1}

    def call(self, x, training):
        if self.recompute and training:
            return _recomputed(self, list(x), training)
        return self.pack(self._run(x, training))

    def call_layers(self, x, training, check_losses=True):
        """As `Stage.call_layers`, the last item the stage's output (for `_recomputed`)."""
        return [self.pack(self._run(x, training, check_losses=check_losses))]

    def units(self, x, training):
        units = []

        def on_call(op, inputs, outputs):
            weights = op.trainable_variables if isinstance(op, keras.layers.Layer) else []
            units.append(Unit(weights, inputs, outputs, shared=op.name in self._shared))

        return units, self.pack(self._run(x, training, on_call=on_call))

    def flatten(self, y):
        return keras.tree.flatten(y)

    def pack(self, flat):
        """The stage's output: the list it gives, or the model's outputs in their structure."""
        if self.structure is None:
            return list(flat)
        outputs = keras.tree.pack_sequence_as(self.structure, list(flat))
        if isinstance(outputs, (list, tuple)) and len(outputs) == 1:
            return outputs[0]  # as Functional.call (`unpack_singleton`)
        return outputs

    def _run(self, x, training, check_losses=True, on_call=None):
        ys = run_calls(
            self.route, self.calls, self.takes, self.gives, list(x), training=training, on_call=on_call
        )
        if check_losses:
            for layer in self.layers:
                _refuse_added_losses(layer.name, len(layer.losses) - _regularized(layer))
        return ys


def graph_stages(model, devices, balance, recompute, serial):
    """The placed copy of functional `model` over `devices` (one per stage) and its stages.

    Returns:
        (copy, stages, partition): the `SplitGraph` copy (the user's layers, names and
        weights layout, each layer's variables on its stage's device), the `GraphStage`s in
        order, and per stage `_graph.describe`'s row (its calls, and the tensors it takes
        and gives).

    Raises:
        BalanceError: the graph cannot be cut (see `_graph.plan`), or a shared layer's calls
            fall in different stages.
    """
    copy, partition = graph_split(model, devices, balance, name=f"{model.name}_pipelined_graph")
    route = copy._tfscale_route
    the_plan = route.plan
    for part, calls in enumerate(the_plan.calls):
        for call in calls:
            home = the_plan.home[call.layer]
            if home != part:
                raise BalanceError(
                    f"Cannot pipeline model {model.name!r}: layer {call.layer!r} is called in stage "
                    f"{home} and in stage {part}, and a pipeline stage must hold every call of its "
                    "layers (their variables live on one device). Expected an explicit balance "
                    "(calls per stage) that keeps its calls in one stage, or the layer split "
                    "(get('model_split')), which shares a layer across devices."
                )
    inputs = [route.keys[id(t)] for t in keras.tree.flatten(copy.input)]
    outputs = [route.keys[id(t)] for t in keras.tree.flatten(copy.output)]
    last = len(the_plan.calls) - 1
    stages = [
        GraphStage(
            index,
            route,
            device,
            recompute,
            serial,
            takes=inputs if index == 0 else the_plan.takes(index),
            gives=outputs if index == last else the_plan.gives(index),
            structure=copy.output if index == last else None,
        )
        for index, device in enumerate(devices)
    ]
    return copy, stages, partition
