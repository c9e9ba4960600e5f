"""The measured timeline of one pipelined training step, and its Gantt chart.

Measurement: TensorFlow's profiler (`tf.profiler.experimental.start/stop`) records every op
the executor runs, with its thread, start and duration, without adding ops to the graph.
(Timestamp ops inside the graph would not do: `tf.function`'s automatic control
dependencies chain every stateful op without a resource input in program order, which
would serialise the stages.) Each op's name carries its group's scope
`pipeline/s{stage}_{F|B}{microbatch}`, so a group's interval is [first op start, last op
end]. The trace is read from the `.xplane.pb` file the profiler writes, with the protobuf
class TensorFlow ships (`tensorflow.tsl.profiler.protobuf.xplane_pb2`, TF 2.16-2.21; a
private module path, used only here).
"""

import dataclasses
import glob
import os
import re
import shutil
import tempfile

from tfscale.strategies import _schedule

__all__ = ["PipelineTrace", "plot", "trace_train_step"]

# Forward ops are named `pipeline/s1_F3/...`; a tape names the gradient ops of a forward op
# `gradient_tape/<forward op name>`, so `gradient_tape/pipeline/s1_F3/...` is backward B3.
# Ops that compute nothing: a variable read runs as soon as the variable is free (it holds no
# activation), sends/receives are added between devices by the partitioner. They are left out
# of a group's interval, which thus spans the group's computation.
_BOOKKEEPING = frozenset(
    ["ReadVariableOp", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp", "Identity"]
)
_GROUP = re.compile(r"(?:^|/)(gradient_tape/)?pipeline/s(\d+)_([FB])(\d+)/")


@dataclasses.dataclass(frozen=True)
class PipelineTrace:
    """One measured step: per `Step` its (start, end) in seconds from the step's first op.

    Attributes:
        schedule, num_stages, num_microbatches: what ran.
        intervals: dict `Step` -> (start, end) seconds.
        live_activations: per stage, the most micro-batches alive at once (forward
            started, backward not finished), from the measured intervals.
        bubble: measured idle share, 1 - busy / (S * makespan), a stage's busy time
            being the union of its ops' execution intervals.
        theoretical_bubble: (S - 1) / (M + S - 1).
        makespan: seconds from the first forward start to the last backward end.
    """

    schedule: str
    num_stages: int
    num_microbatches: int
    intervals: dict
    live_activations: list
    bubble: float
    theoretical_bubble: float
    makespan: float


def _xplane_events(logdir):
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = plane.event_metadata
            for line in plane.lines:
                for event in line.events:
                    start_ns = line.timestamp_ns + event.offset_ps / 1000.0
                    yield names[event.metadata_id].name, start_ns, start_ns + event.duration_ps / 1000.0


def _group_intervals(events):
    """Per `Step` its [first op start, last op end], and every op as (stage, start, end)."""
    groups, ops = {}, []
    for name, start, end in events:
        match = _GROUP.search(name)
        if match is None or name.rpartition(":")[2] in _BOOKKEEPING:
            continue
        tape, stage, kind, microbatch = match.groups()
        step = _schedule.Step(int(stage), "B" if tape else kind, int(microbatch))
        a, b = groups.get(step, (start, end))
        groups[step] = (min(a, start), max(b, end))
        ops.append((step, start, end))
    return groups, ops


def trace_train_step(model, x, y, sample_weight=None):
    """Runs one real training step of a `PipelinedModel` under the profiler and times it.

    The step is a normal `train_on_batch` (it updates the weights). A first, unprofiled
    step traces the graph, so that the profiled one measures only execution.

    Returns:
        A `PipelineTrace`.
    """
    import tensorflow as tf

    model.train_on_batch(x, y, sample_weight=sample_weight)
    logdir = tempfile.mkdtemp(prefix="tfscale_pipeline_trace_")
    try:
        tf.profiler.experimental.start(logdir)
        try:
            model.train_on_batch(x, y, sample_weight=sample_weight)
        finally:
            tf.profiler.experimental.stop()
        groups, ops = _group_intervals(_xplane_events(logdir))
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    return _summarise(groups, ops, model.schedule, len(model.stages), model.num_microbatches)


def _summarise(groups, ops, schedule, num_stages, num_microbatches):
    expected = {s for order in _schedule.order(schedule, num_stages, num_microbatches) for s in order}
    missing = expected - set(groups)
    if missing:
        raise RuntimeError(f"The profiler trace lacks {len(missing)} pipeline step(s), e.g. {min(missing)}.")
    groups = {s: groups[s] for s in expected}
    origin = min(a for a, _ in groups.values())
    intervals = {s: ((a - origin) / 1e9, (b - origin) / 1e9) for s, (a, b) in groups.items()}
    spans = [(step.stage, (a - origin) / 1e9, (b - origin) / 1e9) for step, a, b in ops if step in groups]
    return PipelineTrace(
        schedule=schedule,
        num_stages=num_stages,
        num_microbatches=num_microbatches,
        intervals=intervals,
        live_activations=_schedule.live_activations(intervals, num_stages),
        bubble=_schedule.bubble_fraction(spans, num_stages),
        theoretical_bubble=_schedule.theoretical_bubble(num_stages, num_microbatches),
        makespan=max(b for _, b in intervals.values()),
    )


def plot(trace, path, title=None):
    """Writes a Gantt chart PNG of a `PipelineTrace`: stage x time, forward/backward coloured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    colours = {"F": "#4C72B0", "B": "#DD8452"}
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.55 * trace.num_stages), dpi=90)
    for step, (start, end) in sorted(trace.intervals.items()):
        row = trace.num_stages - 1 - step.stage
        ms = (start * 1e3, (end - start) * 1e3)
        ax.broken_barh([ms], (row - 0.4, 0.8), facecolors=colours[step.kind], edgecolor="white", lw=0.5)
        ax.text(ms[0] + ms[1] / 2, row, f"{step.kind}{step.microbatch}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(trace.num_stages))
    ax.set_yticklabels([f"stage {s}" for s in reversed(range(trace.num_stages))])
    ax.set_xlabel("time in the step (ms)")
    ax.set_xlim(0, trace.makespan * 1e3)
    handles = [
        matplotlib.patches.Patch(color=c, label=k)
        for k, c in (("forward", colours["F"]), ("backward", colours["B"]))
    ]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    ax.set_title(
        title
        or (
            f"{trace.schedule} S={trace.num_stages} M={trace.num_microbatches}: measured bubble "
            f"{trace.bubble:.0%} (theory {trace.theoretical_bubble:.0%}), live activations "
            f"{trace.live_activations}"
        ),
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
