"""The planning report of a pipelined model: memory per device and bytes moved per step.

Per device: the layers, parameter bytes and optimizer-slot bytes (read from where each
variable lives), and activation bytes: the most micro-batches alive at once on the device
in a profiled step (`trace_step`'s `live_activations`) x the bytes of one micro-batch's
layer outputs in its stages (the activations kept for the backward).

Per step, bytes sent between devices, measured beside the formula. Measured: the traced
training step (fixed batch shape) is walked op by op, and every tensor whose producer and
consumer ops are placed on different devices counts once per destination device (what
TensorFlow's graph partitioner turns into one `_Send`/`_Recv` pair). Edges between
pipeline ops (`pipeline/...` scopes) of one replica are activations (forward outputs and
their gradients); edges into `data_parallel/all_reduce` are gradients; the rest (slicing
the batch, loss terms, optimizer scalars) is reported as "other". Formula, per step:

- activations: 2 x sum over the S - 1 stage boundaries of the micro-batch activation size
  x M, per replica (2 x (S-1) x a x M for equal boundaries), times D replicas;
- gradients: the all-reduce of each stage's gradient bytes g_k: each of the D devices of a
  position receives the other D - 1 packed tensors (`strategies._replicas`), D (D-1) sum g_k
  (the bytes of a ring all-reduce, 2 (D-1) g_k, for D = 2).
"""

import dataclasses
import json

import keras
import numpy as np
import tensorflow as tf

from tfscale.strategies._devices import device_key
from tfscale.strategies._placement import device_of
from tfscale.strategies.pipeline import schedules

__all__ = ["DevicePlan", "PlanReport", "plan_report"]


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """One device: its layers and the bytes it holds at the peak of a step."""

    device: str
    layers: list
    param_bytes: int
    slot_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self):
        return self.param_bytes + self.slot_bytes + self.activation_bytes


@dataclasses.dataclass(frozen=True)
class PlanReport:
    """`PipelinedModel.plan_report(x, y)`: memory per device, traffic per step (bytes).

    Attributes:
        devices: a `DevicePlan` per device, replica by replica.
        num_stages, num_microbatches, data_parallel, microbatch_size: S, M, D and the
            samples of one micro-batch.
        boundary_bytes: per stage boundary, one micro-batch's activation bytes.
        stage_gradient_bytes: per stage, its gradient (= trainable parameter) bytes.
        activation_bytes_measured / _formula: activations and their gradients sent
            between the devices of each replica, all replicas, per step.
        gradient_bytes_measured / _formula: gradients sent by the all-reduce, per step.
        other_bytes_measured: every other tensor sent between devices, per step.
    """

    devices: list
    num_stages: int
    num_microbatches: int
    data_parallel: int
    microbatch_size: int
    boundary_bytes: list
    stage_gradient_bytes: list
    activation_bytes_measured: int
    activation_bytes_formula: int
    gradient_bytes_measured: int
    gradient_bytes_formula: int
    other_bytes_measured: int

    @property
    def max_device_bytes(self):
        """The most bytes (parameters + slots + activations) any one device holds."""
        return max(d.total_bytes for d in self.devices)

    @property
    def bytes_measured(self):
        return self.activation_bytes_measured + self.gradient_bytes_measured

    @property
    def bytes_formula(self):
        return self.activation_bytes_formula + self.gradient_bytes_formula

    def to_json(self):
        return json.dumps({**dataclasses.asdict(self), "max_device_bytes": self.max_device_bytes})

    def table(self):
        """The report as a compact text block (what `tfscale-train --plan_report` prints)."""
        rows = [
            f"plan: S={self.num_stages} M={self.num_microbatches} D={self.data_parallel}, "
            f"micro-batch {self.microbatch_size} samples",
            f"{'device':<18} {'params B':>10} {'slots B':>10} {'activ. B':>10} {'total B':>10}  layers",
        ]
        for d in self.devices:
            rows.append(
                f"{d.device:<18} {d.param_bytes:>10} {d.slot_bytes:>10} {d.activation_bytes:>10} "
                f"{d.total_bytes:>10}  {', '.join(d.layers)}"
            )
        rows.append(
            f"per step sent between devices: activations {self.activation_bytes_measured} B measured, "
            f"{self.activation_bytes_formula} B formula (2 x (S-1) x a x M x D); gradients "
            f"{self.gradient_bytes_measured} B measured, {self.gradient_bytes_formula} B formula "
            f"(D x (D-1) x sum g_k); other {self.other_bytes_measured} B"
        )
        return "\n".join(rows)


def plan_report(model, x, y, sample_weight=None):
    """The `PlanReport` of a `PipelinedModel` for batches like `x`, `y` (one global batch).

    Profiles one training step (`trace_step`) and traces one more (not run); the weights
    and optimizer state are as they were before the call.
    """
    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    state = list(model.variables) + list(model.optimizer.variables)
    saved = [v.numpy() for v in state]
    trace = model.trace_step(x, y, sample_weight=sample_weight)
    for variable, value in zip(state, saved):
        variable.assign(value)
    model._data_parallel().sync()  # the other replicas (and their optimizers) back to replica 0
    d, m = len(model.replicas), model.num_microbatches
    microbatch = int(keras.tree.flatten(x)[0].shape[0]) // (d * m)
    first = keras.tree.map_structure(lambda t: t[:microbatch], x)
    outputs, given = _layer_output_bytes(model.stages, model._stage_input(first))
    sent = _sent_bytes(model, x, y, sample_weight)
    # What crosses each cut: a chain's one activation, or every tensor live across a graph's.
    boundaries = given[:-1]
    gradients = [_bytes(stage.trainable_variables) for stage in model.stages]
    return PlanReport(
        devices=_devices(model, trace, outputs),
        num_stages=len(model.stages),
        num_microbatches=m,
        data_parallel=d,
        microbatch_size=microbatch,
        boundary_bytes=boundaries,
        stage_gradient_bytes=gradients,
        activation_bytes_measured=sent["activations"],
        activation_bytes_formula=2 * sum(boundaries) * m * d,
        gradient_bytes_measured=sent["gradients"],
        gradient_bytes_formula=d * (d - 1) * sum(gradients),
        other_bytes_measured=sent["other"],
    )


def _bytes(variables):
    return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in variables)


def _layer_output_bytes(stages, microbatch):
    """Per stage, the bytes of each call's outputs, and those it gives, for one micro-batch (eager)."""
    out, given, value = [], [], microbatch
    for stage in stages:
        with tf.device(stage.device):
            units, value = stage.units(value, training=False)
        out.append([sum(_tensor_bytes(t) for t in unit.outputs) for unit in units])
        given.append(sum(_tensor_bytes(t) for t in keras.tree.flatten(value)))
    return out, given


def _tensor_bytes(t):
    return int(tf.size(t)) * t.dtype.size


def _devices(model, trace, outputs):
    """A `DevicePlan` per device of every replica; replica r's stages mirror replica 0's."""
    optimizers = model._data_parallel().optimizers or [model.optimizer]
    slots = {}
    for optimizer in optimizers:
        for v in optimizer.variables:
            if len(v.shape):  # the slots; not the scalar step count and learning rate
                slots[device_of(v)] = slots.get(device_of(v), 0) + _bytes([v])
    plans = []
    for stages in model.replicas:
        for position in range(trace.num_stages):
            chunks = [
                s
                for s in stages
                if schedules.chunk_device(s.index, trace.num_stages, trace.schedule) == position
            ]
            variables = [v for s in chunks for layer in s.layers for v in layer.weights]
            device = device_of(variables[0]) if variables else chunks[0].device
            # live_activations counts chunk micro-batches; one chunk's kept outputs on average
            per_microbatch = sum(sum(outputs[s.index]) for s in chunks) // len(chunks)
            plans.append(
                DevicePlan(
                    device=device,
                    layers=[layer.name for s in chunks for layer in s.layers],
                    param_bytes=_bytes(variables),
                    slot_bytes=slots.get(device, 0),
                    activation_bytes=trace.live_activations[position] * per_microbatch,
                )
            )
    return plans


def _sent_bytes(model, x, y, sample_weight):
    """Bytes crossing devices in one traced (not run) training step, by kind."""

    def spec(value, dtype=None):
        return tf.TensorSpec(np.shape(value), dtype or tf.as_dtype(np.asarray(value).dtype))

    specs = [keras.tree.map_structure(spec, x), keras.tree.map_structure(spec, y)]
    if sample_weight is not None:
        specs.append(keras.tree.map_structure(lambda w: spec(w, tf.float32), sample_weight))
    graph = tf.function(lambda *data: model.train_step(tuple(data))).get_concrete_function(*specs).graph
    replica_of = {device_key(stage.device): r for r, stages in enumerate(model.replicas) for stage in stages}
    sent, seen = {"activations": 0, "gradients": 0, "other": 0}, set()
    for op in graph.get_operations():
        to = device_key(op.device) if op.device else None
        for tensor in op.inputs:
            source = tensor.op
            start = device_key(source.device) if source.device else None
            if to is None or start is None or to == start or (tensor.name, to) in seen:
                continue
            seen.add((tensor.name, to))
            size = tensor.shape.num_elements()
            if size is None or tensor.dtype == tf.resource:
                continue
            size *= tensor.dtype.size
            if "data_parallel/all_reduce" in op.name:
                sent["gradients"] += size
            elif _pipeline_op(op) and _pipeline_op(source) and replica_of.get(to) == replica_of.get(start):
                sent["activations"] += size
            else:
                sent["other"] += size
    return sent


def _pipeline_op(op):
    return op.name.startswith(("pipeline/", "gradient_tape/pipeline/"))
