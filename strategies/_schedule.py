"""Pipeline schedules: the per-stage order of forward (F) and backward (B) micro-batch steps.

Two schedules, with the terms of their papers:

- GPipe (Huang et al. 2019): every stage runs the forwards of all M micro-batches, then
  their backwards ("flush"); a stage holds the activations of M micro-batches.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage `s` runs `S - s - 1` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining
  backwards; a stage holds at most `S - s` <= S micro-batches of activations.

A schedule here is only an order within each stage. The pipeline turns it into the *fewest*
control dependencies that enforce it (`control_dependencies`), so that the TensorFlow
executor still runs the ops of different stages concurrently as soon as their data is ready.
"""

import collections

__all__ = [
    "SCHEDULES",
    "Step",
    "bubble_fraction",
    "control_dependencies",
    "data_dependencies",
    "live_activations",
    "order",
    "theoretical_bubble",
]

SCHEDULES = ("gpipe", "1f1b")

Step = collections.namedtuple("Step", ["stage", "kind", "microbatch"])
Step.__doc__ = "One micro-batch's forward (kind 'F') or backward (kind 'B') on one stage."


def order(schedule, num_stages, num_microbatches):
    """The order in which each stage runs its steps.

    Args:
        schedule: "gpipe" or "1f1b".
        num_stages: S >= 1.
        num_microbatches: M >= 1.

    Returns:
        A list of S lists of `Step`, one list per stage, in execution order.
    """
    stages = []
    for s in range(num_stages):
        forwards = [Step(s, "F", i) for i in range(num_microbatches)]
        backwards = [Step(s, "B", i) for i in range(num_microbatches)]
        if schedule == "gpipe":
            stages.append(forwards + backwards)
            continue
        warmup = min(num_stages - s - 1, num_microbatches)
        steps = forwards[:warmup]
        for i in range(num_microbatches - warmup):
            steps += [forwards[warmup + i], backwards[i]]
        stages.append(steps + backwards[num_microbatches - warmup :])
    return stages


def data_dependencies(step, num_stages):
    """The steps whose outputs `step` consumes (activations forward, gradients backward)."""
    s, kind, i = step
    if kind == "F":
        return [Step(s - 1, "F", i)] if s > 0 else []
    deps = [Step(s, "F", i)]
    if s < num_stages - 1:
        deps.append(Step(s + 1, "B", i))
    return deps


def control_dependencies(stage_order, strict=False):
    """The fewest same-stage waits that make the executor keep this stage's order.

    With `strict`, each step simply waits for the step before it: the stage runs its
    order exactly, as a device stream executing the schedule's instruction list does.

    A forward waits for the latest backward before it in the order (this is what bounds
    the live activations: in 1F1B, F(i + S - s) waits for B(i)) and for the previous
    forward (a device runs its forwards one after another, as a GPU stream would; logical
    CPU devices share one thread pool and would otherwise run a stage's micro-batches side
    by side, stealing the other stages' cores). A backward waits for the previous backward
    (gradients are summed in micro-batch order, so the sums are bit-identical across
    schedules); the first backward waits for the latest forward before it (GPipe's flush).
    No wait ever crosses stages: data is the only link between devices.

    Args:
        stage_order: one stage's list of `Step`, as from `order`.
        strict: wait for the previous step, whatever its kind.

    Returns:
        A dict from each `Step` to the list of `Step`s it must wait for.
    """
    if strict:
        return {step: stage_order[k - 1 : k] for k, step in enumerate(stage_order)}
    deps, last_f, last_b = {}, None, None
    for step in stage_order:
        waits = []
        if step.kind == "F":
            waits += [w for w in (last_f, last_b) if w is not None]
            last_f = step
        else:
            if last_b is not None:
                waits.append(last_b)
            elif last_f is not None and last_f.microbatch != step.microbatch:
                waits.append(last_f)
            last_b = step
        deps[step] = waits
    return deps


def live_activations(intervals, num_stages):
    """Per stage, the most micro-batches whose activations were alive at once.

    A micro-batch's activations on a stage are alive from the start of its forward to the
    end of its backward there (the backward consumes them).

    Args:
        intervals: a dict from `Step` to its (start, end) time, e.g. measured.
        num_stages: S.

    Returns:
        A list of S ints.
    """
    peaks = []
    for s in range(num_stages):
        events = []
        for step, (start, end) in intervals.items():
            if step.stage != s:
                continue
            if step.kind == "F":
                events.append((start, 1))
            else:
                events.append((end, -1))
        # At equal times a release comes before an allocation (-1 sorts first).
        live = peak = 0
        for _, delta in sorted(events):
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return peaks


def _union_length(spans):
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def bubble_fraction(spans, num_stages):
    """Idle share of the S x makespan rectangle: 1 - busy time / (S * makespan).

    Args:
        spans: (stage, start, end) of every piece of work (e.g. every op) of the step; a
            stage's busy time is the union of its spans, so concurrent ops count once.
        num_stages: S.
    """
    spans = list(spans)
    if not spans:
        return 0.0
    span = max(e for _, _, e in spans) - min(a for _, a, _ in spans)
    busy = sum(_union_length([(a, e) for s, a, e in spans if s == stage]) for stage in range(num_stages))
    return 1.0 - busy / (num_stages * span) if span > 0 else 0.0


def theoretical_bubble(num_stages, num_microbatches):
    """GPipe's bubble for equal stage times: (S - 1) / (M + S - 1); the same for 1F1B."""
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
