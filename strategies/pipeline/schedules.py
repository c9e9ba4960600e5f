"""Pipeline schedules as data: a registry of functions, each giving every stage's ordered ops.

A schedule is a function `(num_stages, num_microbatches, virtual_stages) -> per device, the
list of `Op`s in the order that device runs them`, registered by name in `SCHEDULES`
(`@register("name", bubble=..., activation_bound=...)`, which also records the schedule's
theoretical bubble and activation bound). Its name and constraints (virtual stages, M a
multiple of S, W ops) are its entry in `tfscale._strategy_spec.SCHEDULES`, TensorFlow-free
so that `--schedule` offers and checks them before TensorFlow starts; `register` attaches
that entry to the function as `.constraints`. Adding a schedule is adding that entry and
one such function; the strategy, the step builder and the timeline read everything else
(the op kinds) from here:

- `Kind`: what an op computes -- a micro-batch's forward (F), backward (B: the input
  gradient, and the weight gradient too unless the schedule has W ops), and weight
  gradient (W, zero-bubble schedules). It owns the op-name format
  (`s{stage}_{letter}{microbatch}`) that the step gives its ops and the timeline parses.
- `stage_devices`, `chunk_device`: the stage -> device map. With V virtual stages per
  device there are S x V stages (chunks of the chain); stage c runs on device c mod S
  (round-robin), or, for a schedule whose spec entry says `v_shape` (ZB-V), down the
  devices and back up: device d holds chunks d and 2S - 1 - d. An `Op`'s `stage` is that
  chunk's index, its device (the schedule's "lane") `chunk_device(stage, S, schedule)`.

The schedules here, with the terms of their papers (S devices, M micro-batches):

- GPipe (Huang et al. 2019): every stage runs the forwards of all M micro-batches, then
  their backwards ("flush"); a stage holds the activations of M micro-batches.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage `s` runs `S - s - 1` warm-up
  forwards, then alternates one forward and one backward, then drains the remaining
  backwards; a stage holds at most `S - s` <= S micro-batches of activations.
- Interleaved 1F1B (Megatron-LM, Narayanan et al. 2021): each device holds V non-adjacent
  chunks; warm-up `2 (S - d - 1) + (V - 1) S` chunk-forwards, then 1F1B over chunk-ops, in
  rounds of S micro-batches per chunk. Bubble (S - 1) / (V M + S - 1) of the step; M must
  be a multiple of S.
- ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split
  into B (input gradient, sent upstream at once) and W (weight gradient); stage s defers
  `s` W's, which fill the drain's idle slots. A micro-batch's activations live until its
  W, so every stage holds at most S (1F1B's largest stage); the bubble shrinks from
  (S - 1)(t_F + t_B + t_W) to (S - 1)(t_F + t_B - t_W): a third for equal op times.
- ZB-V (same paper, section 6; PyTorch's ScheduleZBVZeroBubble): V = 2 chunks per device
  in a V, device d holding chunks d and 2S - 1 - d (the first and the last, with the loss,
  on device 0), B and W split. Each device warms up with forwards down the V, then runs
  F B W on each chunk in turn; the W's left at the end fill the drain. With equal
  chunk-op times the only idle is the first forward's way down to device S - 1:
  bubble (S - 1) / (6 M + S - 1) once 2M >= 3S - 1 (half ZB-H1's idle time, with ops of
  half a stage), and a device holds at most min(2S, 2M, M + d + 1) chunk micro-batches,
  i.e. 2S halves of a stage: 1F1B's S micro-batches of a whole stage.

A schedule here is only an order within each stage. The pipeline turns it into the *fewest*
control dependencies that enforce it (`control_dependencies`), so that the TensorFlow
executor still runs the ops of different stages concurrently as soon as their data is ready.
"""

import collections
import enum
import re

from tfscale import _strategy_spec as _spec
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check

__all__ = [
    "SCHEDULES",
    "Kind",
    "Op",
    "Step",
    "activation_bound",
    "bubble_fraction",
    "control_dependencies",
    "data_dependencies",
    "live_activations",
    "op_name",
    "order",
    "parse_op_name",
    "register",
    "registered",
    "simulate",
    "stage_devices",
    "theoretical_bubble",
]


class Kind(str, enum.Enum):
    """What a pipeline op computes for one micro-batch on one stage; its value is its letter."""

    FORWARD = "F"
    BACKWARD = "B"  # the input gradient, and the weights' unless the schedule has W ops
    WEIGHT = "W"  # the weight gradient alone (zero-bubble schedules)

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
# A tape names the gradient ops of a forward op `gradient_tape/<forward op name>` (an
# absolute scope, whatever scope the backward is built in), so
# `gradient_tape/pipeline/s1_F3/...` belongs to backward B3. W ops are built with
# `tf.gradients`, which prefixes the current scope: `pipeline/s1_W3/gradients/...`.
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


def register(name, *, bubble, activation_bound):
    """Decorator: adds a schedule function to `SCHEDULES` under `name`.

    Args:
        name: the `schedule=` option's value, a name in `tfscale._strategy_spec.SCHEDULES`,
            whose entry (the schedule's constraints) the function carries as `.constraints`.
        bubble: `bubble(S, M, V)` -> the idle share of the step for equal op times.
        activation_bound: `activation_bound(S, M, V, d)` -> the most micro-batches (chunk
            micro-batches with V > 1) whose activations device d holds at once.
    """
    if name not in _spec.SCHEDULES:
        raise ValueError(
            f"Schedule {name!r} has no entry in tfscale._strategy_spec.SCHEDULES. Expected its "
            "constraints there first."
        )

    def add(schedule):
        schedule.bubble = bubble
        schedule.activation_bound = activation_bound
        schedule.constraints = _spec.SCHEDULES[name]
        SCHEDULES[name] = schedule
        return schedule

    return add


def _flush_bubble(num_stages, num_microbatches, virtual_stages):
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


@register("gpipe", bubble=_flush_bubble, activation_bound=lambda s, m, v, d: m)
def gpipe(num_stages, num_microbatches, virtual_stages=1):
    """All forwards, then all backwards (the flush), on every stage."""
    return [
        [Op(s, Kind.FORWARD, i) for i in range(num_microbatches)]
        + [Op(s, Kind.BACKWARD, i) for i in range(num_microbatches)]
        for s in range(num_stages)
    ]


@register("1f1b", bubble=_flush_bubble, activation_bound=lambda s, m, v, d: min(s - d, m))
def one_forward_one_backward(num_stages, num_microbatches, virtual_stages=1):
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


def _interleaved_warmup(num_stages, num_microbatches, virtual_stages, device):
    warmup = 2 * (num_stages - device - 1) + (virtual_stages - 1) * num_stages
    return min(warmup, num_microbatches * virtual_stages)


@register(
    "interleaved",
    bubble=lambda s, m, v: (s - 1) / (v * m + s - 1),
    activation_bound=lambda s, m, v, d: min(_interleaved_warmup(s, m, v, d) + 1, m * v),
)
def interleaved(num_stages, num_microbatches, virtual_stages=2):
    """Megatron-LM's interleaved 1F1B: device d runs chunks d, d + S, ..., d + (V-1) S.

    The device's k-th chunk-forward is micro-batch `(k // (S V)) S + k % S` of its chunk
    `(k // S) % V`; its k-th chunk-backward the same with the chunks in reverse order.
    """
    s_, m, v = num_stages, num_microbatches, virtual_stages

    def ops(device, k, kind):
        chunk = (k // s_) % v
        if kind == Kind.BACKWARD:
            chunk = v - 1 - chunk
        return Op(chunk * s_ + device, kind, (k // (s_ * v)) * s_ + k % s_)

    devices = []
    for d in range(s_):
        total, warmup = m * v, _interleaved_warmup(s_, m, v, d)
        order = [ops(d, k, Kind.FORWARD) for k in range(warmup)]
        for k in range(total - warmup):
            order += [ops(d, warmup + k, Kind.FORWARD), ops(d, k, Kind.BACKWARD)]
        devices.append(order + [ops(d, k, Kind.BACKWARD) for k in range(total - warmup, total)])
    return devices


@register(
    "zb-h1",
    bubble=lambda s, m, v: (s - 1) / (3 * m + s - 1),
    activation_bound=lambda s, m, v, d: min(s, m),
)
def zero_bubble_h1(num_stages, num_microbatches, virtual_stages=1):
    """1F1B with B and W split; stage s keeps `s` W's pending, run when the drain idles."""
    stages = []
    for s in range(num_stages):
        warmup = min(num_stages - s - 1, num_microbatches)
        ops, pending = [Op(s, Kind.FORWARD, i) for i in range(warmup)], []
        for i in range(num_microbatches):
            if warmup + i < num_microbatches:
                ops.append(Op(s, Kind.FORWARD, warmup + i))
            ops.append(Op(s, Kind.BACKWARD, i))
            pending.append(Op(s, Kind.WEIGHT, i))
            if len(pending) > s:
                ops.append(pending.pop(0))
        stages.append(ops + pending)
    return stages


def _zb_v_order(num_stages, num_microbatches, device):
    """Device `device`'s ZB-V ops over its chunks d (down the V) and 2S - 1 - d (back up).

    Qi et al.'s construction with t_F = t_B = t_W, as PyTorch's ScheduleZBVZeroBubble builds
    it: the order for max(M, 2S - 1) micro-batches, the ones past M then dropped (so the
    warm-up is the same for small M).
    """
    s_, d = num_stages, device
    down, up = d, 2 * s_ - 1 - d
    count = max(num_microbatches, 2 * s_ - 1)
    ops, next_op = [], {}

    def add(chunk, kind):
        i = next_op.get((chunk, kind), 0)
        next_op[(chunk, kind)] = i + 1
        ops.append(Op(chunk, kind, i))

    def done(chunk, kind):
        return next_op.get((chunk, kind), 0)

    # Warm-up: forwards down the V until the first micro-batch comes back up to this device,
    # then each forward on the way up is followed at once by its B and W.
    for _ in range(2 * (s_ - d) - 1):
        add(down, Kind.FORWARD)
    for _ in range(d):
        add(up, Kind.FORWARD)
        add(down, Kind.FORWARD)
    for _ in range(s_ - d):
        add(up, Kind.FORWARD)
        add(up, Kind.BACKWARD)
        add(up, Kind.WEIGHT)
    # Steady state: F B W on the way down, then F B W on the way up.
    while done(up, Kind.FORWARD) < done(down, Kind.FORWARD) or done(down, Kind.FORWARD) < count:
        if done(down, Kind.FORWARD) < count:
            add(down, Kind.FORWARD)
        add(down, Kind.BACKWARD)
        add(down, Kind.WEIGHT)
        add(up, Kind.FORWARD)
        add(up, Kind.BACKWARD)
        add(up, Kind.WEIGHT)
    # Cool-down: the remaining B's first (they unblock the devices before this one), the
    # W's they leave behind fill the idle slots at the end.
    pending = {down: [], up: []}
    for _ in range(d):
        for chunk in (down, up):
            pending[chunk].append(done(chunk, Kind.BACKWARD))
            add(chunk, Kind.BACKWARD)
    for _ in range(s_ - d):
        pending[down].append(done(down, Kind.BACKWARD))
        add(down, Kind.BACKWARD)
        ops.append(Op(down, Kind.WEIGHT, pending[down].pop(0)))
    ops += [Op(up, Kind.WEIGHT, i) for i in pending[up]]
    ops += [Op(down, Kind.WEIGHT, i) for i in pending[down]]
    return [op for op in ops if op.microbatch < num_microbatches]


def _zb_v_bubble(num_stages, num_microbatches, virtual_stages=2):
    # Equal chunk-op times: 6M ops per device; the step takes 6M + S - 1 (the first
    # forward's way down to the last device) once 2M >= 3S - 1, else 4M + 4S - 2.
    s_, m = num_stages, num_microbatches
    return 1 - 6 * m / max(6 * m + s_ - 1, 4 * m + 4 * s_ - 2)


@register(
    "zb-v",
    bubble=_zb_v_bubble,
    activation_bound=lambda s, m, v, d: min(2 * s, 2 * m, m + d + 1),
)
def zero_bubble_v(num_stages, num_microbatches, virtual_stages=2):
    """ZB-V: two chunks per device in a V (device d: chunks d and 2S - 1 - d), B and W split."""
    return [_zb_v_order(num_stages, num_microbatches, d) for d in range(num_stages)]


def order(schedule, num_stages, num_microbatches, virtual_stages=1):
    """The order in which each device runs its ops.

    Args:
        schedule: a name in `SCHEDULES`.
        num_stages: S >= 1 devices.
        num_microbatches: M >= 1.
        virtual_stages: V >= 1 chunks per device (schedules whose `.constraints` say
            `virtual_stages` only); the `Op`s name chunks 0 .. S V - 1.

    Returns:
        A list of S lists of `Op`, one list per device, in execution order.
    """
    if virtual_stages == 1:  # A schedule function written before V existed takes (S, M).
        return registered(schedule)(num_stages, num_microbatches)
    return registered(schedule)(num_stages, num_microbatches, virtual_stages)


def registered(schedule):
    """The function registered as `schedule`; a `StrategyError` naming the spec's choices if none."""
    return SCHEDULES[check("schedule", schedule)]


def chunk_device(chunk, num_devices, schedule=None):
    """The device (0 .. S - 1) that runs `chunk` of the chain, as `schedule` places chunks.

    Round-robin (Megatron-LM's interleaved layout): chunk c on device c mod S. In a V
    (`Schedule.v_shape`, ZB-V): the chunks go down the devices and back up, c mod S on the
    way down and S - 1 - c mod S on the way up, so device d holds d and 2S - 1 - d.
    """
    device = chunk % num_devices
    if schedule is not None and registered(schedule).constraints.v_shape and (chunk // num_devices) % 2:
        return num_devices - 1 - device
    return device


def stage_devices(devices, num_stages, schedule=None):
    """The device of each stage: `devices` has one name per stage, or one per device.

    With D devices and S = V x D stages, stage s runs on device `chunk_device(s, D,
    schedule)`: s mod D (Megatron-LM's interleaved layout: each device holds V non-adjacent
    chunks of the chain), or in a V for a `v_shape` schedule (ZB-V).

    Raises:
        StrategyError: S is not a multiple of the number of devices.
    """
    devices = list(devices)
    if not devices or num_stages % len(devices):
        raise StrategyError(
            f"{num_stages} stages cannot be spread evenly over {len(devices)} devices. "
            "Expected a number of stages that is a multiple of the number of devices."
        )
    return [devices[chunk_device(s, len(devices), schedule)] for s in range(num_stages)]


def data_dependencies(step, num_stages):
    """The steps whose outputs `step` consumes (activations forward, gradients backward)."""
    s, kind, i = step
    if kind == Kind.FORWARD:
        return [Op(s - 1, Kind.FORWARD, i)] if s > 0 else []
    if kind == Kind.WEIGHT:
        return [Op(s, Kind.BACKWARD, i)]  # the gradients of the layer outputs, from B
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
    A weight gradient waits for the previous one (the sums again), and a forward also for
    the latest W before it (a micro-batch's activations live until its W: the bound).
    No wait ever crosses devices: data is the only link between them.

    Args:
        stage_order: one stage's list of `Op`, as from `order`.
        strict: wait for the previous step, whatever its kind.

    Returns:
        A dict from each `Step` to the list of `Op`s it must wait for.
    """
    if strict:
        return {step: stage_order[k - 1 : k] for k, step in enumerate(stage_order)}
    deps, last_f, last_b, last_w = {}, None, None, None
    for step in stage_order:
        waits = []
        if step.kind == Kind.FORWARD:
            waits += [w for w in (last_f, last_b, last_w) if w is not None]
            last_f = step
        elif step.kind == Kind.WEIGHT:
            waits += [] if last_w is None else [last_w]
            last_w = step
        else:
            if last_b is not None:
                waits.append(last_b)
            elif last_f is not None and last_f.microbatch != step.microbatch:
                waits.append(last_f)
            last_b = step
        deps[step] = waits
    return deps


def live_activations(intervals, num_stages, schedule=None):
    """Per device, the most (chunk) micro-batches whose activations were alive at once.

    A micro-batch's activations on a stage are alive from the start of its forward to the
    end of its last backward op there (B, or W when the schedule splits it: both consume
    them). Stage c counts on device `chunk_device(c, S, schedule)` (V chunks per device
    with V > 1: c mod S, or in a V for ZB-V).

    Args:
        intervals: a dict from `Op` to its (start, end) time, e.g. measured.
        num_stages: S devices.
        schedule: the schedule's name, for its placement of chunks (None: round-robin).

    Returns:
        A list of S ints.
    """
    alive = {}
    for step, (start, end) in intervals.items():
        key = (step.stage, step.microbatch)
        a, b = alive.get(key, (float("inf"), float("-inf")))
        if step.kind == Kind.FORWARD:
            alive[key] = (start, b)
        else:
            alive[key] = (a, max(b, end))
    peaks = []
    for d in range(num_stages):
        # At equal times a release comes before an allocation (-1 sorts first).
        events = sorted(
            event
            for (stage, _), (start, end) in alive.items()
            if chunk_device(stage, num_stages, schedule) == d
            for event in ((start, 1), (end, -1))
        )
        live = peak = 0
        for _, delta in events:
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


def theoretical_bubble(
    num_stages, num_microbatches, schedule=_spec.PipelineOptions.schedule, virtual_stages=1
):
    """The schedule's idle share of the step for equal op times (as registered).

    GPipe and 1F1B: (S - 1) / (M + S - 1); interleaved: (S - 1) / (V M + S - 1); ZB-H1 with
    t_F = t_B = t_W: (S - 1) / (3 M + S - 1). `schedule` defaults to the pipeline's.
    """
    return registered(schedule).bubble(num_stages, num_microbatches, virtual_stages)


def activation_bound(schedule, num_stages, num_microbatches, virtual_stages=1):
    """Per device, the most (chunk) micro-batches of activations the schedule keeps."""
    bound = registered(schedule).activation_bound
    return [bound(num_stages, num_microbatches, virtual_stages, d) for d in range(num_stages)]


def simulate(orders, costs, virtual_stages=1):
    """Runs the per-device orders with fixed op times; returns each `Op`'s (start, end).

    Each device runs its ops in order, each as soon as its data (`data_dependencies`) is
    there. A check of a schedule's arithmetic (its bubble) and of its being deadlock-free.

    Args:
        orders: as from `order`.
        costs: dict `Kind` -> time of one op of that kind; an `Op` key gives that one op
            its own time (e.g. the duration measured for it in a trace).
        virtual_stages: V.

    Raises:
        StrategyError: the orders deadlock (an op waits for data no device will produce).
    """
    num_chunks = len(orders) * virtual_stages
    done, clock, position = {}, [0.0] * len(orders), [0] * len(orders)
    progress = True
    while progress:
        progress = False
        for d, lane in enumerate(orders):
            while position[d] < len(lane):
                step = lane[position[d]]
                deps = data_dependencies(step, num_chunks)
                if any(dep not in done for dep in deps):
                    break
                start = max([clock[d]] + [done[dep][1] for dep in deps])
                clock[d] = start + (costs[step] if step in costs else costs[Kind(step.kind)])
                done[step] = (start, clock[d])
                position[d] += 1
                progress = True
    stuck = [lane[p] for lane, p in zip(orders, position) if p < len(lane)]
    if stuck:
        raise StrategyError(f"The schedule deadlocks: {stuck[0]} waits for data that never comes.")
    return done
