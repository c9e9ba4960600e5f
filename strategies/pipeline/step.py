"""One training batch of a pipeline as ONE dataflow graph: forwards, backwards, gradient sums.

Every micro-batch forward and backward of every stage becomes a group of ops placed on its
stage's device (`tf.device`) and named by `schedules.op_name` (`pipeline/s1_B3`; the profiler
timeline finds them by that name). Groups are linked only by

- data: activations flow forward, gradients backward, between neighbouring stages (a
  graph's stage takes and gives every tensor live across its cuts: lists, `pipeline.graph`);
- the schedule's same-device waits (`schedules.control_dependencies`), which bound the live
  activations (1F1B) or make the flush (GPipe).

With V virtual stages per device, `stages` holds the S x V chunks in chain order; chunk c
is on device `schedules.chunk_device(c, S, schedule)` (c mod S, or in a V for ZB-V), and
the schedule orders each device's ops over its chunks.

Nothing else orders them, so TensorFlow's executor runs groups of different stages at the
same time as soon as their inputs exist: that overlap is the pipeline. Each forward records
its own `tf.GradientTape`; its backward asks that tape for the gradients of the stage's
output (upstream gradient passed as `output_gradients`) with respect to the stage's input
and variables, the same chain rule as one tape over the whole model.

Schedules with W ops (zero bubble) split that backward: B asks the tape only for the
gradients of the stage input and of each layer's output; W later computes each layer's
weight gradient from its output gradient (`tf.gradients(output, weights, grad_ys)`: the
layer's own backward, e.g. `x^T dz` for a Dense layer). The weight-gradient ops the tape
also creates in B feed nothing and are pruned by TensorFlow; they are left out of the
serialising chain (`_needed`), where a control edge would make a dead op live (TF 2.21's
Grappler drops them even then, measured: the filter keeps the split from relying on it).
"""

import keras
import tensorflow as tf

from tfscale.compat import tf_graph_edit
from tfscale.strategies import _gradients, _replicas
from tfscale.strategies._devices import device_type
from tfscale.strategies._errors import StrategyError
from tfscale.strategies.pipeline import schedules
from tfscale.strategies.pipeline.schedules import Kind, Op

__all__ = ["Stage", "forward_only", "run_batch"]


class Stage:
    """One pipeline stage: its consecutive layers and its device (not tracked by Keras).

    `call_kwargs`: per layer, the constant keyword arguments the user's functional model
    passes to it. As in Keras 3's functional model (`functional.operation_fn`), the
    `training` of the call wins over one recorded there: `BatchNormalization()(x,
    training=False)` trains in training mode under `fit` (Keras 3.15).
    """

    def __init__(self, index, layers, device, recompute=False, serial=False, *, call_kwargs=None):
        self.index = index
        self.layers = list(layers)
        self.device = device
        self.recompute = recompute
        self.serial = serial
        self.call_kwargs = list(call_kwargs or [{} for _ in self.layers])
        # The transposed-weight rewrite helps Eigen's CPU MatMul only (see tf_graph_edit).
        self.pretranspose = device_type(device) == "CPU"

    @property
    def trainable_variables(self):
        return [v for layer in self.layers for v in layer.trainable_variables]

    def call(self, x, training):
        if self.recompute and training:
            # Keeps only the stage input; the backward re-runs the forward for the rest.
            return _recomputed(self, x, training)
        return self.call_layers(x, training)[-1]

    def call_layers(self, x, training, check_losses=True):
        """Each layer's output, in order (the last is the stage's output); no recompute."""
        outputs = []
        for layer, kwargs in zip(self.layers, self.call_kwargs):
            x = layer(x, **{**kwargs, "training": training})
            if check_losses:
                _refuse_added_losses(layer.name, len(layer.losses) - _regularized(layer))
            outputs.append(x)
        return outputs

    def units(self, x, training):
        """(units, output): per layer a `Unit` (its weights, input and output), and the stage's output.

        A split backward (W ops) asks for each unit's output gradient, then its weights'.
        """
        outputs = self.call_layers(x, training)
        inputs = [x, *outputs[:-1]]
        units = [
            Unit(layer.trainable_variables, [a], [y]) for layer, a, y in zip(self.layers, inputs, outputs)
        ]
        return units, outputs[-1]


class Unit:
    """One call in a stage, as a split backward sees it: its weights, input and output tensors.

    `shared`: its layer is called more than once in the stage, so its weight gradient is
    taken with its inputs held fixed (the other calls add their own).
    """

    def __init__(self, weights, inputs, outputs, shared=False):
        self.weights, self.inputs, self.outputs, self.shared = list(weights), inputs, outputs, shared


def _regularized(layer):
    return sum(1 for w in layer.trainable_weights if getattr(w, "regularizer", None) is not None)


def _refuse_added_losses(name, added):
    """Fails (while the step is traced, before it runs) when a layer called `add_loss`."""
    if added > 0:
        raise StrategyError(
            f"Layer {name!r} adds a loss in call() (`add_loss`), which a pipeline computes per "
            "micro-batch and cannot add up to Keras's whole-batch value. Expected layers without "
            "add_loss: compute that term in the compiled loss, or use a weight regularizer."
        )


def _recomputed(stage, x, training):
    """`stage`'s forward under `tf.recompute_grad`, its state updates made once.

    The backward's second forward must see the state the first one saw: the same Dropout
    masks (seed generators), so the gradient is that of the loss computed; and it must not
    move BatchNormalization's averages again. Both forwards run in a `keras.StatelessScope`
    that starts from the state read before the first; only the first's updates are kept.
    """
    state = [v for layer in stage.layers for v in layer.variables if not v.trainable]
    start = [tf.identity(v.value) for v in state]
    calls = []

    def forward(inputs):
        first = not calls
        calls.append(first)
        with keras.StatelessScope(state_mapping=list(zip(state, start)), collect_losses=True) as scope:
            y = stage.call_layers(inputs, training, check_losses=False)[-1]
        # In the scope, `add_loss` values go to `scope.losses` (weight penalties do not).
        _refuse_added_losses(", ".join(layer.name for layer in stage.layers), len(scope.losses))
        if first:
            for variable, value in zip(state, start):
                new = scope.get_current_value(variable)
                if new is not value:
                    variable.assign(new)
        return y

    if not isinstance(x, list):
        return tf.recompute_grad(forward)(x)
    # A graph's stage (`pipeline.graph.GraphStage`) takes and gives lists of tensors.
    flat = tf.recompute_grad(lambda *xs: stage.flatten(forward(list(xs))))(*x)
    return stage.pack(flat)


def _differentiable(x):
    return x.dtype.is_floating or x.dtype.is_complex


def _flat_outputs(result):
    # expand_composites: a sparse gradient gates its step through its values and indices.
    return [t for t in tf.nest.flatten(result, expand_composites=True) if isinstance(t, tf.Tensor)]


def _needed(operations, results):
    """The ops among `operations` whose outputs reach `results` (the others are dead)."""
    created = set(operations)
    seen, stack = set(), [r.op if isinstance(r, tf.Tensor) else r for r in results]
    while stack:
        op = stack.pop()
        if op in seen or op not in created:
            continue
        seen.add(op)
        stack += [t.op for t in op.inputs] + list(op.control_inputs)
    return [op for op in operations if op in seen]


class _Batch:
    """The mutable state while the ops of one batch are being created."""

    def __init__(self, stages, schedule, inputs, loss_fn, virtual_stages=1):
        self.stages = stages
        self.inputs = inputs
        self.loss_fn = loss_fn
        self.num_stages = len(stages)
        self.orders = schedules.order(
            schedule, self.num_stages // virtual_stages, len(inputs), virtual_stages
        )
        self.split_weights = any(op.kind == Kind.WEIGHT for order in self.orders for op in order)
        self.waits = {}
        for device, device_order in enumerate(self.orders):
            # Chunk d is device d's first (round-robin and V alike); every chunk of a device
            # has its `serial` setting.
            self.waits.update(schedules.control_dependencies(device_order, strict=stages[device].serial))
        self.done = {}
        self.gradients = [None] * self.num_stages
        self.transposes = {}

    def emit(self, step):
        if step in self.done:
            return
        for dep in schedules.data_dependencies(step, self.num_stages) + self.waits[step]:
            self.emit(dep)
        stage = self.stages[step.stage]
        serial = stage.serial and not tf.executing_eagerly()
        waits = list(self.waits[step])
        if serial and step.kind == Kind.BACKWARD:
            waits.append(Op(step.stage, Kind.FORWARD, step.microbatch))  # F all done, as on a stream
        gate = [t for dep in waits for t in self.done[dep]["gate"]]
        graph = tf.compat.v1.get_default_graph() if serial else None
        first = len(graph.get_operations()) if serial else 0
        build = {Kind.FORWARD: self._forward, Kind.BACKWARD: self._backward, Kind.WEIGHT: self._weight}
        with tf.device(stage.device), tf.name_scope(schedules.op_name(step)), tf.control_dependencies(gate):
            self.done[step] = build[Kind(step.kind)](step)
        if serial:
            created = _needed(graph.get_operations()[first:], self.done[step]["gate"])
            last = tf_graph_edit.chain_in_creation_order(created)
            # The gate's results depend on every created contraction (`_needed`), so the last
            # one joins the gate only where there are no results: a control fan-out on it would
            # keep grappler from fusing it with its BiasAdd and activation as plain Keras's graph
            # does, and float16 rounds the two differently (`REGRESSIONS`, tests/test_equivalence.py).
            if not self.done[step]["gate"] and last is not None:
                self.done[step]["gate"] = [last]

    def _forward(self, step):
        stage, last = self.stages[step.stage], step.stage == self.num_stages - 1
        if step.stage == 0:
            x = self.inputs[step.microbatch]
        else:
            x = self.done[Op(step.stage - 1, Kind.FORWARD, step.microbatch)]["y"]
        # A chain's stage takes one tensor; a graph's the list of tensors crossing its cut.
        xs = _leaves(x)
        # W asks an eager tape a second time; in a graph it uses `tf.gradients` instead.
        persistent = self.split_weights and tf.executing_eagerly()
        with (
            tf.GradientTape(persistent=persistent) as tape,
            _replicas.in_microbatch(step.microbatch, len(self.inputs)),
        ):
            for t in xs:
                if _differentiable(t):
                    tape.watch(t)
            units, y = stage.units(x, training=True) if self.split_weights else (None, None)
            y = stage.call(x, training=True) if units is None else y
            loss = self.loss_fn(step.microbatch, y) if last else None
        ys = _leaves(y)
        # Later steps wait on a Snapshot of `y`, not on `y`'s op: grappler's remapper fuses no
        # activation that has control fan-outs (see `emit`). An Identity would not do: grappler
        # bypasses it and moves its control fan-outs back onto `y`'s op.
        gate = [t if tf.executing_eagerly() else tf.raw_ops.Snapshot(input=t) for t in ys]
        gate += [] if loss is None else [loss]
        return {"x": x, "xs": xs, "y": y, "ys": ys, "units": units, "loss": loss, "tape": tape, "gate": gate}

    def _backward(self, step):
        s, i = step.stage, step.microbatch
        forward = self.done[Op(s, Kind.FORWARD, i)]
        if s == self.num_stages - 1:
            targets, upstream = [forward["loss"]], None
        else:
            # Per tensor given to the next stage, the gradient it sends back (None: not a float).
            sent = self.done[Op(s + 1, Kind.BACKWARD, i)]["dx"]
            given = [(y, g) for y, g in zip(forward["ys"], sent) if g is not None]
            targets, upstream = [y for y, _ in given], [g for _, g in given]
        needs = [s > 0 and _differentiable(t) for t in forward["xs"]]
        asked = [t for t, need in zip(forward["xs"], needs) if need]
        if self.split_weights:
            return self._input_gradients(step, forward, (targets, upstream), needs, asked)
        variables = self.stages[s].trainable_variables
        sources = asked + variables
        rewrite = self.stages[s].pretranspose and not tf.executing_eagerly()
        graph = tf.compat.v1.get_default_graph() if rewrite else None
        first = 0 if graph is None else len(graph.get_operations())
        grads = _gradient(forward["tape"], targets, sources, upstream)
        if graph is not None:
            tf_graph_edit.pretranspose_matmul_weights(graph.get_operations()[first:], self.transposes)
        dx = _input_grads(forward["xs"], needs, grads[: len(asked)])
        self._accumulate(s, i, grads[len(asked) :], variables)
        # The sums belong to this step: the next step of the stage waits for them too.
        return {"dx": dx, "gate": _flat_outputs([dx, self.gradients[s]])}

    def _accumulate(self, s, i, grads, variables):
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
        if not _never_empty(_leaves(self.inputs[i])[0]):
            # An empty micro-batch (a final batch smaller than D x M) adds nothing; a layer
            # with batch statistics (BatchNormalization) would give it NaN gradients.
            empty = tf.equal(tf.shape(_leaves(self.inputs[i])[0])[0], 0)
            grads = [g if isinstance(g, tf.IndexedSlices) else _unless(empty, g) for g in grads]
        # Summed in micro-batch order (the B or W chain guarantees it), on the stage device;
        # a sparse gradient stays sparse, its rows in batch order (`_gradients`).
        acc = self.gradients[s]
        self.gradients[s] = grads if acc is None else [_gradients.add(a, g) for a, g in zip(acc, grads)]

    def _input_gradients(self, step, forward, target, needs, asked_inputs):
        """B of a split backward: the gradients of the stage input and of each unit's output.

        `target`: (targets, upstream), the tensors differentiated and their output gradients.
        """
        targets, upstream = target
        units = forward["units"]
        consumed = {id(t) for unit in units for t in unit.inputs}
        given = {} if upstream is None else {id(t): g for t, g in zip(targets, upstream)}
        # An output given to the next stage and used by no later call of this one has the
        # upstream gradient; the others are asked of the tape (the last stage's come from the
        # loss). Non-float outputs (indices) have none.
        asked = [
            (k, j)
            for k, unit in enumerate(units)
            for j, y in enumerate(unit.outputs)
            if _differentiable(y) and (id(y) not in given or id(y) in consumed)
        ]
        sources = asked_inputs + [units[k].outputs[j] for k, j in asked]
        rewrite = self.stages[step.stage].pretranspose and not tf.executing_eagerly()
        graph = tf.compat.v1.get_default_graph() if rewrite else None
        first = 0 if graph is None else len(graph.get_operations())
        grads = _gradient(forward["tape"], targets, sources, upstream) if sources else []
        if graph is not None:
            tf_graph_edit.pretranspose_matmul_weights(graph.get_operations()[first:], self.transposes)
        dx = _input_grads(forward["xs"], needs, grads[: len(asked_inputs)])
        dys = [[given.get(id(y)) for y in unit.outputs] for unit in units]
        for (k, j), g in zip(asked, grads[len(asked_inputs) :]):
            dys[k][j] = g
        return {"dx": dx, "dys": dys, "gate": _flat_outputs([dx, dys])}

    def _weight(self, step):
        """W of a split backward: each unit's weight gradient from its output gradient."""
        s, i = step.stage, step.microbatch
        forward, dys = self.done[Op(s, Kind.FORWARD, i)], self.done[Op(s, Kind.BACKWARD, i)]["dys"]
        sums = {}
        for unit, unit_dys in zip(forward["units"], dys):
            pairs = [(y, dy) for y, dy in zip(unit.outputs, unit_dys) if dy is not None]
            if not unit.weights or not pairs:
                continue
            ys, grad_ys = [y for y, _ in pairs], [dy for _, dy in pairs]
            ys, grad_ys = (ys[0], grad_ys[0]) if len(ys) == 1 else (ys, grad_ys)
            if tf.executing_eagerly():
                if unit.shared:
                    raise StrategyError(
                        "A layer called twice in one pipeline stage cannot take a split backward "
                        "(zb-h1, zb-v) when run eagerly. Expected run_eagerly=False, or another schedule."
                    )
                grads = forward["tape"].gradient(ys, unit.weights, output_gradients=grad_ys)
            else:
                # A shared layer's call: its inputs held fixed, so each call adds its own part.
                stop = unit.inputs if unit.shared else None
                grads = tf.gradients(ys, unit.weights, grad_ys=grad_ys, stop_gradients=stop)
            for weight, g in zip(unit.weights, grads):
                if g is not None:
                    key = id(weight)
                    sums[key] = g if key not in sums else _gradients.add(sums[key], g)
        variables = self.stages[s].trainable_variables
        self._accumulate(s, i, [sums.get(id(v)) for v in variables], variables)
        return {"gate": _flat_outputs(self.gradients[s])}


def _leaves(value):
    """A stage's input or output as a list of tensors (a chain's: one)."""
    return keras.tree.flatten(value)


def _gradient(tape, targets, sources, upstream):
    """`tape.gradient` of the targets (one tensor asked as such, as a chain's stage does)."""
    if not targets:
        return [None] * len(sources)  # nothing of the next stage's depends on this one's floats
    if len(targets) == 1:
        return tape.gradient(targets[0], sources, output_gradients=None if upstream is None else upstream[0])
    return tape.gradient(targets, sources, output_gradients=upstream)


def _input_grads(xs, needs, grads):
    """Per stage input, its gradient (zeros where the stage did not use it), or None if not asked."""
    found, out = iter(grads), []
    for x, need in zip(xs, needs):
        g = next(found) if need else None
        out.append(tf.zeros_like(x) if need and g is None else g)
    return out


def _unless(empty, gradient):
    return tf.where(empty, tf.zeros_like(gradient), gradient)


def _never_empty(x):
    return x.shape.rank is not None and x.shape[0] is not None and x.shape[0] > 0


def run_batch(stages, schedule, inputs, loss_fn, virtual_stages=1):
    """Creates the ops of one pipelined forward + backward over micro-batches.

    Args:
        stages: the list of `Stage` (S x V chunks, in chain order).
        schedule: a name in `schedules.SCHEDULES`.
        inputs: the list of M micro-batches of the first stage's input.
        loss_fn: `loss_fn(i, y_pred_i)` -> the scalar this micro-batch adds to the loss to
            differentiate (already weighted and, if needed, scaled for the optimizer).
        virtual_stages: V chunks per device.

    Returns:
        (y_preds, losses, gradients): the M last-stage outputs, the M loss terms, and per
        stage the list of summed gradients of its trainable variables.
    """
    batch = _Batch(stages, schedule, inputs, loss_fn, virtual_stages)
    for stage_order in batch.orders:
        for step in stage_order:
            batch.emit(step)
    last = len(stages) - 1
    finals = [batch.done[Op(last, Kind.FORWARD, i)] for i in range(len(inputs))]
    return [f["y"] for f in finals], [f["loss"] for f in finals], batch.gradients


def forward_only(stages, inputs, training=False):
    """The micro-batched forward of inference: each micro-batch flows through the stages.

    Each micro-batch is marked (`in_microbatch`): an RNN cell with dropout draws its masks
    even in inference (Keras's `RNN.call`, unused there), and one device draws them once per
    batch; so do the micro-batches, from one seed state (`_replicas.draw_as_whole_batch`).
    """
    outputs = []
    for i, x in enumerate(inputs):
        y = x
        for stage in stages:
            with (
                tf.device(stage.device),
                tf.name_scope(schedules.op_name(Op(stage.index, Kind.FORWARD, i))),
                _replicas.in_microbatch(i, len(inputs)),
            ):
                y = stage.call(y, training=training)
        outputs.append(y)
    return outputs
