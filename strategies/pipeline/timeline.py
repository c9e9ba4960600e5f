"""The measured timeline of one pipelined training step, and its Gantt chart.

Measurement: TensorFlow's profiler (`tf.profiler.experimental.start/stop`) records every op
the executor runs, with its thread, start and duration, without adding ops to the graph.
(Timestamp ops inside the graph would not do: `tf.function`'s automatic control
dependencies chain every stateful op without a resource input in program order, which
would serialise the stages.) Each op's name carries its group's scope
(`schedules.op_name`, e.g. `pipeline/s1_F3`), so a group's interval is [first op start, last
op end]. The trace is read from the `.xplane.pb` file the profiler writes
(`tfscale.compat.tf_xplane`). Op kinds, their letters and colours come from
`schedules.Kind`, so a schedule with new kinds needs no change here.
"""

import dataclasses
import shutil
import tempfile

from tfscale.compat import tf_xplane
from tfscale.errors import FAILED_RUN
from tfscale.strategies._errors import StrategyError
from tfscale.strategies.pipeline import schedules
from tfscale.strategies.pipeline.schedules import Kind

__all__ = ["PipelineTrace", "TraceError", "plot", "trace_train_step"]

# Ops that compute nothing: a variable read runs as soon as the variable is free (it holds no
# activation), sends/receives are added between devices by the partitioner. They are left out
# of a group's interval, which thus spans the group's computation.
_BOOKKEEPING = frozenset(
    ["ReadVariableOp", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp", "Identity"]
)


class TraceError(StrategyError, RuntimeError):
    """The profiler's trace of a pipelined step lacks some of its ops (the run, not the input, failed)."""

    exit_status = FAILED_RUN


@dataclasses.dataclass(frozen=True)
class PipelineTrace:
    """One measured step: per `Op` its (start, end) in seconds from the step's first op.

    Attributes:
        schedule, num_stages, num_microbatches: what ran (S devices).
        intervals: dict `Op` -> (start, end) seconds; an `Op`'s stage is its chunk with
            V > 1 (on device `schedules.chunk_device(stage, num_stages, schedule)`).
        live_activations: per device, the most (chunk) micro-batches alive at once
            (forward started, last backward op -- B or W -- not finished), from the
            measured intervals.
        bubble: measured idle share, 1 - busy / (S * makespan), a device's busy time
            being the union of its ops' execution intervals.
        theoretical_bubble: the schedule's, for equal op times
            (`schedules.theoretical_bubble`).
        makespan: seconds from the first forward start to the last backward end.
        virtual_stages: V, chunks per device.
        activation_bound: per device, the schedule's bound on `live_activations`.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    intervals: dict
    live_activations: list
    bubble: float
    theoretical_bubble: float
    makespan: float
    virtual_stages: int
    activation_bound: list = dataclasses.field(default_factory=list)


def _group_intervals(events):
    """Per `Op` its [first op start, last op end], and every op as (stage, start, end)."""
    groups, ops = {}, []
    for name, start, end in events:
        step = schedules.parse_op_name(name)
        if step is None or name.rpartition(":")[2] in _BOOKKEEPING:
            continue
        a, b = groups.get(step, (start, end))
        groups[step] = (min(a, start), max(b, end))
        ops.append((step, start, end))
    return groups, ops


def trace_train_step(model, x, y, sample_weight=None):
    """Runs one real training step of a `PipelinedModel` under the profiler and times it.

    The step is a normal `train_on_batch`: it updates the weights and the optimizer once.
    A first, unprofiled step traces the graph, so that the profiled one measures only
    execution; its updates are undone (every model and optimizer variable restored).

    Returns:
        A `PipelineTrace`.

    Raises:
        StrategyError: `model` is not a compiled `PipelinedModel`.
        TraceError: the profiler's trace lacks some of the step's ops.
    """
    import tensorflow as tf

    if not all(hasattr(model, a) for a in ("virtual_stages", "num_microbatches", "schedule", "stages")) or (
        getattr(model, "optimizer", None) is None
    ):
        raise StrategyError(
            f"Invalid value for argument `model`. Received: model={type(model).__name__}. Expected a "
            "compiled model built in a `PipelineStrategy` scope (a PipelinedModel)."
        )

    if not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)
    state = list(model.variables) + list(model.optimizer.variables)
    saved = [v.numpy() for v in state]
    model.train_on_batch(x, y, sample_weight=sample_weight)
    for variable, value in zip(state, saved):
        variable.assign(value)
    logdir = tempfile.mkdtemp(prefix="tfscale_pipeline_trace_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            model.train_on_batch(x, y, sample_weight=sample_weight)
        finally:
            tf.profiler.experimental.stop()
        groups, ops = _group_intervals(tf_xplane.op_events(logdir))
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    virtual, m = model.virtual_stages, model.num_microbatches
    return _summarise(groups, ops, model.schedule, len(model.stages) // virtual, m, virtual_stages=virtual)


def _summarise(groups, ops, schedule, num_stages, num_microbatches, *, virtual_stages):
    orders = schedules.order(schedule, num_stages, num_microbatches, virtual_stages)
    expected = {s for order in orders for s in order}
    # With W split off, a B or W can compute nothing: no weights (pooling, reshaping) for W;
    # a first stage of one layer for B (that layer's output gradient came from upstream).
    split = any(op.kind == Kind.WEIGHT for op in expected)
    missing = {s for s in expected - set(groups) if not split or s.kind == Kind.FORWARD}
    if missing:
        raise TraceError(f"The profiler trace lacks {len(missing)} pipeline step(s), e.g. {min(missing)}.")
    groups = {s: groups[s] for s in expected if s in groups}
    origin = min(a for a, _ in groups.values())
    intervals = {s: ((a - origin) / 1e9, (b - origin) / 1e9) for s, (a, b) in groups.items()}
    spans = [
        (schedules.chunk_device(step.stage, num_stages, schedule), (a - origin) / 1e9, (b - origin) / 1e9)
        for step, a, b in ops
        if step in groups
    ]
    return PipelineTrace(
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        intervals=intervals,
        live_activations=schedules.live_activations(intervals, num_stages, schedule),
        bubble=schedules.bubble_fraction(spans, num_stages),
        theoretical_bubble=schedules.theoretical_bubble(
            num_stages, num_microbatches, schedule, virtual_stages
        ),
        makespan=max(b for _, b in intervals.values()),
        virtual_stages=virtual_stages,
        activation_bound=schedules.activation_bound(schedule, num_stages, num_microbatches, virtual_stages),
    )


def plot(trace, path, title=None):
    """Writes a Gantt chart PNG of a `PipelineTrace`: device x time, each `Kind` its colour.

    With V > 1 a box's label names its chunk too (`F3.1`: micro-batch 3 of the device's
    second chunk) and later chunks are hatched.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    # Wide enough for each device's boxes to hold their labels (32 a device with V=2, M=8).
    per_device = len(trace.intervals) / trace.num_stages
    fig, ax = plt.subplots(figsize=(max(10, 0.5 * per_device), 0.6 + 0.55 * trace.num_stages), dpi=90)
    virtual = trace.virtual_stages
    for step, (start, end) in sorted(trace.intervals.items()):
        device = schedules.chunk_device(step.stage, trace.num_stages, trace.schedule)
        chunk = step.stage // trace.num_stages
        row = trace.num_stages - 1 - device
        ms = (start * 1e3, (end - start) * 1e3)
        ax.broken_barh(
            [ms],
            (row - 0.4, 0.8),
            facecolors=Kind(step.kind).colour,
            edgecolor="white",
            lw=0.5,
            hatch="//" if chunk else None,
        )
        label = f"{Kind(step.kind).value}{step.microbatch}" + (f".{chunk}" if virtual > 1 else "")
        ax.text(ms[0] + ms[1] / 2, row, label, ha="center", va="center", fontsize=6 if virtual > 1 else 7)
    ax.set_yticks(range(trace.num_stages))
    name = "device" if virtual > 1 else "stage"
    ax.set_yticklabels([f"{name} {s}" for s in reversed(range(trace.num_stages))])
    ax.set_xlabel("time in the step (ms)")
    ax.set_xlim(0, trace.makespan * 1e3)
    kinds = sorted({Kind(step.kind) for step in trace.intervals}, key=list(Kind).index)
    handles = [matplotlib.patches.Patch(color=kind.colour, label=kind.label) for kind in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(
        title
        or (
            f"{trace.schedule} S={trace.num_stages} M={trace.num_microbatches}"
            + (f" V={virtual}" if virtual > 1 else "")
            + ": measured bubble "
            f"{trace.bubble:.0%} (theory {trace.theoretical_bubble:.0%}), live activations "
            f"{trace.live_activations}"
        ),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
