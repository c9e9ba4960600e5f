"""Splitting profiled training steps into input, compute and all-reduce time, from trace events.

A step is one call of Keras's train function, the event the profiler records on the Python
thread that calls it (`one_step_on_iterator`, `multi_step_on_iterator`, ...). Inside it every instant is
given to one kind, by priority: all-reduce while any replica is inside a
`CollectiveReduceV2` launch (waiting for a slower peer included), else input while any
replica waits in the iterator's get_next, else compute while any executor thread runs an
op. Compute is the rest of the step: it includes the host's dispatch (Python, the
tf.function call, executor scheduling between ops), which is also reported on its own
(`host_s`: no op running). So input + compute + all-reduce is the step event's length;
what the step events miss is Keras's loop between steps (callbacks, Python), which the
wall clock around the profiled steps includes.
Also writes the trace as a Chrome trace and draws the stacked bars of several workers.
"""

import gzip
import json
import re

__all__ = ["KINDS", "chrome_trace", "plot", "split_steps"]

KINDS = ("input", "compute", "allreduce")
_COLOURS = {"input": "#4c9be8", "compute": "#59a14f", "allreduce": "#e15759"}
_STEP = re.compile(r"^(one|multi)_step_on_(iterator|data)")
_COLLECTIVE = ":CollectiveReduceV2"
# The iterator's get_next on the consuming side (TraceMe and op names, TF 2.16-2.21).
_INPUT = re.compile(r"^IteratorGetNext|:(IteratorGetNext\w*|MultiDeviceIteratorGetNextFromShard)$")


def _kind(event, main_lines):
    if event.name.endswith(_COLLECTIVE):
        return "allreduce"
    if _INPUT.search(event.name):
        return "input"
    if event.line in main_lines or event.line.startswith("tf_data") or event.name.startswith("Threadpool"):
        return None  # The producer side of tf.data runs ahead, in the background.
    return "compute"


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _minus(intervals, taken):
    """Parts of the (merged) `intervals` outside the (merged) `taken` ones."""
    out = []
    for first, end in intervals:
        start = first
        for t_start, t_end in taken:
            if t_end <= start or t_start >= end:
                continue
            if t_start > start:
                out.append([start, t_start])
            start = max(start, t_end)
            if start >= end:
                break
        if start < end:
            out.append([start, end])
    return out


def _length(intervals):
    return sum(end - start for start, end in intervals)


def split_steps(events):
    """Per step event: `{"step_s", "input_s", "compute_s", "allreduce_s", "host_s"}` (seconds).

    Args:
        events: `profiler_xplane.TraceEvent`s of one trace.
    """
    steps = sorted((e for e in events if _STEP.match(e.name)), key=lambda e: e.start_ns)
    # The thread that calls the step; named after the process ("python", "pytest", ...).
    main_lines = {e.line for e in steps}
    by_kind = {kind: [] for kind in KINDS}
    for event in events:
        kind = _kind(event, main_lines)
        if kind:
            by_kind[kind].append((event.start_ns, event.end_ns))
    result = []
    for step in steps:
        window = (step.start_ns, step.end_ns)
        clipped = {
            kind: _union(
                (max(s, window[0]), min(e, window[1])) for s, e in spans if e > window[0] and s < window[1]
            )
            for kind, spans in by_kind.items()
        }
        taken, split = [], {}
        for kind in ("allreduce", "input", "compute"):  # Priority order.
            own = _minus(clipped[kind], taken)
            split[f"{kind}_s"] = _length(own) * 1e-9
            taken = _union(taken + own)
        step_s = (window[1] - window[0]) * 1e-9
        # Compute is the rest of the step; the part of it with no op running is the host's
        # dispatch (Python, tf.function call, executor scheduling), reported on its own.
        host_s = step_s - sum(split.values())
        split["compute_s"] += host_s
        result.append({"step_s": step_s, **split, "host_s": host_s})
    return result


def chrome_trace(events, path):
    """Writes `events` as a Chrome trace (chrome://tracing, Perfetto), gzipped if `path` ends .gz."""
    origin = min((e.start_ns for e in events), default=0)
    threads = {}
    trace = [
        {
            "name": e.name,
            "ph": "X",
            "pid": 0,
            "tid": threads.setdefault(e.line, len(threads)),
            "ts": (e.start_ns - origin) / 1000.0,
            "dur": (e.end_ns - e.start_ns) / 1000.0,
        }
        for e in events
    ]
    trace += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": line}}
        for line, tid in threads.items()
    ]
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "wt") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def plot(reports, path):
    """Stacked bars (input, compute, all-reduce) per worker per profiled step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(2 + 3 * len(reports), 3.5), sharey=True, squeeze=False)
    for ax, report in zip(axes[0], reports):
        steps = report["steps"]
        first = report["profiled_steps"][0]
        xs = range(first, first + len(steps))
        bottom = [0.0] * len(steps)
        for kind in KINDS:
            ms = [1e3 * s[f"{kind}_s"] for s in steps]
            ax.bar(xs, ms, bottom=bottom, color=_COLOURS[kind], label=kind)
            bottom = [b + m for b, m in zip(bottom, ms)]
        ax.set_title(report["task"])
        ax.set_xlabel("step")
    axes[0][0].set_ylabel("ms")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
