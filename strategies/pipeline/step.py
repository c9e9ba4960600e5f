"""One training batch of a pipeline as ONE dataflow graph: forwards, backwards, gradient sums.

Every micro-batch forward and backward of every stage becomes a group of ops placed on its
stage's device (`tf.device`) and named by `schedules.op_name` (`pipeline/s1_B3`; the profiler
timeline finds them by that name). Groups are linked only by

- data: activations flow forward, gradients backward, between neighbouring stages;
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

    return tf.recompute_grad(forward)(x)


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
        # W asks an eager tape a second time; in a graph it uses `tf.gradients` instead.
        persistent = self.split_weights and tf.executing_eagerly()
        with (
            tf.GradientTape(persistent=persistent) as tape,
            _replicas.in_microbatch(step.microbatch, len(self.inputs)),
        ):
            if _differentiable(x):
                tape.watch(x)
            outputs = stage.call_layers(x, training=True) if self.split_weights else None
            y = stage.call(x, training=True) if outputs is None else outputs[-1]
            loss = self.loss_fn(step.microbatch, y) if last else None
        # Later steps wait on a Snapshot of `y`, not on `y`'s op: grappler's remapper fuses no
        # activation that has control fan-outs (see `emit`). An Identity would not do: grappler
        # bypasses it and moves its control fan-outs back onto `y`'s op.
        waited = y if tf.executing_eagerly() else tf.raw_ops.Snapshot(input=y)
        gate = [waited] if loss is None else [waited, loss]
        return {"x": x, "y": y, "outputs": outputs, "loss": loss, "tape": tape, "gate": gate}

    def _backward(self, step):
        s, i = step.stage, step.microbatch
        forward = self.done[Op(s, Kind.FORWARD, i)]
        if s == self.num_stages - 1:
            target, upstream = forward["loss"], None
        else:
            target, upstream = forward["y"], self.done[Op(s + 1, Kind.BACKWARD, i)]["dx"]
        needs_dx = s > 0 and _differentiable(forward["x"])
        if self.split_weights:
            return self._input_gradients(step, forward, target, upstream, needs_dx)
        variables = self.stages[s].trainable_variables
        sources = ([forward["x"]] if needs_dx else []) + variables
        rewrite = self.stages[s].pretranspose and not tf.executing_eagerly()
        graph = tf.compat.v1.get_default_graph() if rewrite else None
        first = 0 if graph is None else len(graph.get_operations())
        grads = forward["tape"].gradient(target, sources, output_gradients=upstream)
        if graph is not None:
            tf_graph_edit.pretranspose_matmul_weights(graph.get_operations()[first:], self.transposes)
        dx = grads[0] if needs_dx else None
        self._accumulate(s, i, grads[len(sources) - len(variables) :], variables)
        # The sums belong to this step: the next step of the stage waits for them too.
        return {"dx": dx, "gate": _flat_outputs([dx, self.gradients[s]])}

    def _accumulate(self, s, i, grads, variables):
        grads = [tf.zeros_like(v) if g is None else g for g, v in zip(grads, variables)]
        if not _never_empty(self.inputs[i]):
            # An empty micro-batch (a final batch smaller than D x M) adds nothing; a layer
            # with batch statistics (BatchNormalization) would give it NaN gradients.
            empty = tf.equal(tf.shape(self.inputs[i])[0], 0)
            grads = [g if isinstance(g, tf.IndexedSlices) else _unless(empty, g) for g in grads]
        # Summed in micro-batch order (the B or W chain guarantees it), on the stage device;
        # a sparse gradient stays sparse, its rows in batch order (`_gradients`).
        acc = self.gradients[s]
        self.gradients[s] = grads if acc is None else [_gradients.add(a, g) for a, g in zip(acc, grads)]

    def _input_gradients(self, step, forward, target, upstream, needs_dx):
        """B of a split backward: the gradients of the stage input and of each layer output."""
        outputs = forward["outputs"]
        last = step.stage == self.num_stages - 1
        # A middle stage's last output gradient is the upstream one; the last stage's comes
        # from the loss. Non-float outputs (indices) have none.
        asked = [k for k, y in enumerate(outputs) if _differentiable(y) and (last or k < len(outputs) - 1)]
        sources = ([forward["x"]] if needs_dx else []) + [outputs[k] for k in asked]
        rewrite = self.stages[step.stage].pretranspose and not tf.executing_eagerly()
        graph = tf.compat.v1.get_default_graph() if rewrite else None
        first = 0 if graph is None else len(graph.get_operations())
        grads = forward["tape"].gradient(target, sources, output_gradients=upstream) if sources else []
        if graph is not None:
            tf_graph_edit.pretranspose_matmul_weights(graph.get_operations()[first:], self.transposes)
        dx = grads[0] if needs_dx else None
        dys = [None] * len(outputs)
        for k, g in zip(asked, grads[len(sources) - len(asked) :]):
            dys[k] = g
        if not last:
            dys[-1] = upstream
        return {"dx": dx, "dys": dys, "gate": _flat_outputs([dx, dys])}

    def _weight(self, step):
        """W of a split backward: each layer's weight gradient from its output gradient."""
        s, i = step.stage, step.microbatch
        forward, dys = self.done[Op(s, Kind.FORWARD, i)], self.done[Op(s, Kind.BACKWARD, i)]["dys"]
        grads = []
        for layer, y, dy in zip(self.stages[s].layers, forward["outputs"], dys):
            weights = layer.trainable_variables
            if not weights or dy is None:
                grads += [None] * len(weights)
            elif tf.executing_eagerly():
                grads += forward["tape"].gradient(y, weights, output_gradients=dy)
            else:
                grads += tf.gradients(y, weights, grad_ys=dy)
        self._accumulate(s, i, grads, self.stages[s].trainable_variables)
        return {"gate": _flat_outputs(self.gradients[s])}


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
