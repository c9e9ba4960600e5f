"""Pipeline schedules as data: a registry of functions, each giving every stage's ordered ops.

A schedule is a function `(num_stages, num_microbatches) -> per stage, the list of `Op`s in
the order that stage runs them`, registered by name in `SCHEDULES` (`@register("name")`).
Adding a schedule is adding one such function; the strategy, the step builder and the
timeline read everything else (the names, the op kinds) from here:

- `Kind`: what an op computes -- a micro-batch's forward (F), backward (B), and room for a
  separate weight-gradient (W, zero-bubble schedules). It owns the op-name format
  (`s{stage}_{letter}{microbatch}`) that the step gives its ops and the timeline parses.
- `stage_devices`: the stage -> device map, so V (virtual) stages per device fit.

The two schedules here, with the terms of their papers:

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
import enum
import re

__all__ = [
    "SCHEDULES",
    "Kind",
    "Op",
    "Step",
    "bubble_fraction",
    "control_dependencies",
    "data_dependencies",
    "live_activations",
    "op_name",
    "order",
    "parse_op_name",
    "register",
    "stage_devices",
    "theoretical_bubble",
]


class Kind(str, enum.Enum):
    """What a pipeline op computes for one micro-batch on one stage; its value is its letter."""

    FORWARD = "F"
    BACKWARD = "B"  # the input gradient, and (until a schedule separates W) the weights'
    WEIGHT = "W"  # weight gradient alone: room for zero-bubble schedules (none uses it yet)

    def __str__(self):
        return self.value

    @property
    def label(self):
        return self.name.lower().replace("weight", "weight gradient")

    @property
    def colour(self):
        """The timeline's colour for this kind."""
        return _COLOURS[self]


_COLOURS = {Kind.FORWARD: "#4C72B0", Kind.BACKWARD: "#DD8452", Kind.WEIGHT: "#55A868"}

Op = collections.namedtuple("Op", ["stage", "kind", "microbatch"])
Op.__doc__ = "One micro-batch's op of one `Kind` on one stage."
Step = Op  # The name before ops had kinds beyond F and B; kept for callers.

_LETTERS = "".join(kind.value for kind in Kind)
# A tape names the gradient ops of a forward op `gradient_tape/<forward op name>`, so
# `gradient_tape/pipeline/s1_F3/...` belongs to backward B3. Gradient ops created inside a
# B or W scope carry that scope first (`pipeline/s1_W3/gradient_tape/...`), the first match.
_OP_NAME = re.compile(rf"(?:^|/)(gradient_tape/)?pipeline/s(\d+)_([{_LETTERS}])(\d+)/")


def op_name(op):
    """The name scope of an op's TensorFlow ops, e.g. `pipeline/s1_B3`."""
    return f"pipeline/s{op.stage}_{Kind(op.kind).value}{op.microbatch}"


def parse_op_name(name):
    """The `Op` a TensorFlow op (or profiler event) name belongs to, or None."""
    match = _OP_NAME.search(name)
    if match is None:
        return None
    tape, stage, letter, microbatch = match.groups()
    kind = Kind(letter)
    return Op(int(stage), Kind.BACKWARD if tape and kind == Kind.FORWARD else kind, int(microbatch))


SCHEDULES = {}


def register(name):
    """Decorator: adds a schedule function to `SCHEDULES` under `name`."""

    def add(schedule):
        SCHEDULES[name] = schedule
        return schedule

    return add


@register("gpipe")
def gpipe(num_stages, num_microbatches):
    """All forwards, then all backwards (the flush), on every stage."""
    return [
        [Op(s, Kind.FORWARD, i) for i in range(num_microbatches)]
        + [Op(s, Kind.BACKWARD, i) for i in range(num_microbatches)]
        for s in range(num_stages)
    ]


@register("1f1b")
def one_forward_one_backward(num_stages, num_microbatches):
    """Warm-up forwards, then one forward and one backward in turn, then the drain."""
    stages = []
    for s in range(num_stages):
        forwards = [Op(s, Kind.FORWARD, i) for i in range(num_microbatches)]
        backwards = [Op(s, Kind.BACKWARD, i) for i in range(num_microbatches)]
        warmup = min(num_stages - s - 1, num_microbatches)
        ops = forwards[:warmup]
        for i in range(num_microbatches - warmup):
            ops += [forwards[warmup + i], backwards[i]]
        stages.append(ops + backwards[num_microbatches - warmup :])
    return stages


def order(schedule, num_stages, num_microbatches):
    """The order in which each stage runs its ops.

    Args:
        schedule: a name in `SCHEDULES`.
        num_stages: S >= 1.
        num_microbatches: M >= 1.

    Returns:
        A list of S lists of `Op`, one list per stage, in execution order.
    """
    return SCHEDULES[schedule](num_stages, num_microbatches)


def stage_devices(devices, num_stages):
    """The device of each stage: `devices` has one name per stage, or one per device.

    With D devices and S = V x D stages, stage s runs on device s mod D (Megatron-LM's
    interleaved layout: each device holds V non-adjacent chunks of the chain).

    Raises:
        ValueError: S is not a multiple of the number of devices.
    """
    devices = list(devices)
    if num_stages % len(devices):
        raise ValueError(
            f"{num_stages} stages cannot be spread evenly over {len(devices)} devices. "
            "Expected a number of stages that is a multiple of the number of devices."
        )
    return [devices[s % len(devices)] for s in range(num_stages)]


def data_dependencies(step, num_stages):
    """The steps whose outputs `step` consumes (activations forward, gradients backward)."""
    s, kind, i = step
    if kind == Kind.FORWARD:
        return [Op(s - 1, Kind.FORWARD, i)] if s > 0 else []
    deps = [Op(s, Kind.FORWARD, i)]
    if s < num_stages - 1:
        deps.append(Op(s + 1, Kind.BACKWARD, i))
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
        stage_order: one stage's list of `Op`, as from `order`.
        strict: wait for the previous step, whatever its kind.

    Returns:
        A dict from each `Step` to the list of `Op`s it must wait for.
    """
    if strict:
        return {step: stage_order[k - 1 : k] for k, step in enumerate(stage_order)}
    deps, last_f, last_b = {}, None, None
    for step in stage_order:
        waits = []
        if step.kind == Kind.FORWARD:
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
        intervals: a dict from `Op` to its (start, end) time, e.g. measured.
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
            if step.kind == Kind.FORWARD:
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
