"""The strategies as plain data, TensorFlow-free: names, options, schedule rules, replicas.

`tfscale.flags` reads it to define and check the flags before TensorFlow starts;
`tfscale.strategies.get`, `PipelineStrategy` and `ModelSplitStrategy` read it to build
and check a strategy. Each name, default and rule is written here once, and nowhere else:

- `OPTIONS`: strategy name -> the frozen dataclass of its options, with their types and
  defaults (`PipelineOptions().num_microbatches` is the pipeline's default M). `NAMES`,
  the names `tfscale.strategies.get` takes, are its keys in order.
- `SCHEDULES`: pipeline schedule name -> `Schedule`, that schedule's constraints as fields;
  `schedule_problem` applies them (the op orders live in `strategies/pipeline/schedules.py`,
  which registers one function per entry here).
- `RULES`: option -> `Rule`, the type and range of its values (a positive integer, one of
  `SCHEDULES`, ...); `option_problem` applies one. The strategies raise it, the flags'
  validators say it for their flag: no other module checks an option's range again.
- `expected_replicas`, `copy_devices`, `microbatches`: what the options alone say about
  replicas, the devices of one model copy and micro-batches (flags check a batch with them
  before TensorFlow starts; `get` places a model-parallel copy with `copy_devices`).

Nothing here raises: the callers word the errors (`StrategyError` in the strategies, a
flag error in the flags), so each message stays where its caller's style is.

>>> PipelineOptions().num_stages, tuple(SCHEDULES)
(2, ('gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v'))
"""

import dataclasses
import inspect
import math
from typing import Any, Callable, Literal, Optional, Sequence, Union

from tfscale import _auto

__all__ = [
    "BALANCE_METHODS",
    "COMMUNICATIONS",
    "CROSS_DEVICE_OPS",
    "DEFAULT_CLUSTER_TIMEOUT",
    "GRADIENT_COMPRESSIONS",
    "MODEL_PARALLEL",
    "NAMES",
    "OPTIONS",
    "RULES",
    "SCHEDULES",
    "ZERO_STAGES",
    "AutoOptions",
    "DefaultOptions",
    "MirroredOptions",
    "ModelSplitOptions",
    "MultiWorkerOptions",
    "OneDeviceOptions",
    "PipelineOptions",
    "Rule",
    "Schedule",
    "TPUOptions",
    "copy_devices",
    "expected_replicas",
    "in_words",
    "microbatches",
    "option_names",
    "option_problem",
    "owners",
    "schedule_problem",
    "signature",
]

# The values an option may take, where they are a closed set.
COMMUNICATIONS = ("auto", "ring", "nccl")  # collective implementation of multi_worker
CROSS_DEVICE_OPS = ("nccl", "hierarchical_copy", "reduction_to_one_device")  # mirrored's all-reduce
GRADIENT_COMPRESSIONS = ("fp16", "bf16")  # the all-reduce's dtype (None: the gradients' own)
ZERO_STAGES = (0, 1, 2, 3)  # valid values of zero_stage (which ones run: strategies/_zero.py)
BALANCE_METHODS = ("parameters", "uniform", "time")  # how to cut a chain (or a list of counts)
DEFAULT_CLUSTER_TIMEOUT = 300.0  # seconds: long enough for slow hosts to start, short of a hang


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A pipeline schedule's constraints, the fields of its entry in `SCHEDULES`.

    Attributes:
        virtual_stages: the schedule takes V > 1 chunks of the chain per device.
        rounds_of_stages: it runs rounds of S micro-batches, so M must be a multiple of S.
        weight_ops: it splits each backward into B and a deferred W (the weight gradient),
            which needs each layer's kept output, so `recompute=True` is refused.
        exact_virtual_stages: V must be this number (None: any V the other fields allow).
        v_shape: chunks are placed in a V (zigzag) instead of round-robin: with S devices,
            device d holds chunks d and 2S - 1 - d, so the first and the last chunk (the
            loss) are on device 0, and each device's second chunk runs right after the
            first on the way back (ZB-V).
    """

    virtual_stages: bool = False
    rounds_of_stages: bool = False
    weight_ops: bool = False
    exact_virtual_stages: Optional[int] = None
    v_shape: bool = False


# Pipeline schedules, in the order `--schedule` and the errors list them.
SCHEDULES = {
    "gpipe": Schedule(),
    "1f1b": Schedule(),
    "interleaved": Schedule(virtual_stages=True, rounds_of_stages=True),
    "zb-h1": Schedule(weight_ops=True),
    "zb-v": Schedule(virtual_stages=True, weight_ops=True, exact_virtual_stages=2, v_shape=True),
}


@dataclasses.dataclass(frozen=True)
class DefaultOptions:
    """`get("default")`: TensorFlow's default strategy; no options."""


@dataclasses.dataclass(frozen=True)
class OneDeviceOptions:
    """`get("one_device")`: `device` None means the first GPU, else the CPU."""

    device: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class TPUOptions:
    """`get("tpu")`: a TPU name or grpc:// address; None finds the local TPU."""

    tpu: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class MirroredOptions:
    """`get("mirrored")`: at most one of `devices`, `num_gpus`, `cpu_replicas` (None: every GPU)."""

    devices: Optional[Sequence[str]] = None
    num_gpus: Optional[int] = None
    cross_device_ops: Optional[Literal[CROSS_DEVICE_OPS]] = None
    cpu_replicas: Optional[int] = None
    gradient_compression: Optional[Literal[GRADIENT_COMPRESSIONS]] = None
    bytes_per_pack: int = 0  # 0: one pack
    timeout_seconds: Optional[float] = None
    zero_stage: Literal[ZERO_STAGES] = 0
    # True: each replica's trainable BatchNormalization normalises its slice by the slice's
    # statistics (Keras's own behaviour); False: by the global batch's, as on one device.
    replica_statistics: bool = False
    # True: each replica's Dropout (GaussianNoise, ...) draws its own numbers for its slice
    # (Keras's own behaviour, cheaper); False: the numbers one device draws for the batch.
    replica_random: bool = False


@dataclasses.dataclass(frozen=True)
class MultiWorkerOptions:
    """`get("multi_worker")`: the collectives and how long to wait for the cluster's peers."""

    communication: Literal[COMMUNICATIONS] = "auto"
    timeout_seconds: Optional[float] = None
    cluster_resolver: Any = None
    cpu_replicas: Optional[int] = None
    gradient_compression: Optional[Literal[GRADIENT_COMPRESSIONS]] = None
    bytes_per_pack: int = MirroredOptions.bytes_per_pack
    cluster_timeout: float = DEFAULT_CLUSTER_TIMEOUT
    replica_statistics: bool = MirroredOptions.replica_statistics
    replica_random: bool = MirroredOptions.replica_random


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """`get("auto")`: passed on to the strategy it picks, so their defaults are that one's."""

    cpu_replicas: Optional[int] = None
    tpu: Optional[str] = TPUOptions.tpu
    communication: Literal[COMMUNICATIONS] = MultiWorkerOptions.communication
    timeout_seconds: Optional[float] = MultiWorkerOptions.timeout_seconds
    cluster_timeout: float = MultiWorkerOptions.cluster_timeout


@dataclasses.dataclass(frozen=True)
class ModelSplitOptions:
    """`get("model_split")` (`cpu_replicas`: get's alone) and `ModelSplitStrategy(...)`."""

    devices: Optional[Sequence[str]] = None
    num_devices: Optional[int] = None  # K, devices of one copy; None: as many as there are
    balance: Union[Literal[BALANCE_METHODS], Sequence[int]] = "parameters"
    tensor_parallel: Union[bool, int] = False
    tensor_layers: Optional[Sequence[str]] = None
    sample_input: Any = None
    data_parallel: int = 1  # D, copies of the split model
    cpu_replicas: Optional[int] = None


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """`get("pipeline")` (`cpu_replicas`: get's alone) and `PipelineStrategy(...)`."""

    num_stages: int = 2  # S, stages (and devices) of one copy
    num_microbatches: int = 4  # M, micro-batches per replica's batch
    schedule: Literal[tuple(SCHEDULES)] = "1f1b"
    virtual_stages: int = 1  # V, chunks per device (schedules with Schedule.virtual_stages)
    devices: Optional[Sequence[str]] = None
    balance: Union[Literal[BALANCE_METHODS], Sequence[int]] = ModelSplitOptions.balance
    recompute: bool = False
    serialize_stages: Optional[bool] = None  # None: True on CPU devices
    deferred_batch_norm: bool = True
    data_parallel: int = ModelSplitOptions.data_parallel
    microbatch_statistics: bool = False
    cpu_replicas: Optional[int] = None


# The names of `tfscale.strategies.get`, in order, and the options of each.
OPTIONS = {
    "auto": AutoOptions,
    "default": DefaultOptions,
    "one_device": OneDeviceOptions,
    "mirrored": MirroredOptions,
    "multi_worker": MultiWorkerOptions,
    "tpu": TPUOptions,
    "pipeline": PipelineOptions,
    "model_split": ModelSplitOptions,
}
NAMES = tuple(OPTIONS)
# The strategies that split the model (tfscale-train splits it for them).
MODEL_PARALLEL = ("pipeline", "model_split")


def option_names(name):
    """The options strategy `name` takes, in order."""
    return tuple(field.name for field in dataclasses.fields(OPTIONS[name]))


def owners(option):
    """The strategies that take `option`, in `NAMES` order."""
    return tuple(name for name in OPTIONS if option in option_names(name))


def signature(name, leave_out=("cpu_replicas",)):
    """The keyword-only signature of strategy `name`'s options, defaults included.

    A class that takes `**options` sets it as its `__signature__`, so `help()`,
    `inspect.signature` and editors show each option and its default from here.
    """
    return inspect.Signature(
        [
            inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default)
            for field in dataclasses.fields(OPTIONS[name])
            if field.name not in leave_out
        ]
    )


def in_words(values):
    """`(0, 1, 2, 3)` -> `"0, 1, 2 or 3"`."""
    *first, last = map(str, values)
    return f"{', '.join(first)} or {last}" if first else last


def schedule_problem(schedule, options):
    """Why `options` (a `PipelineOptions`) break the constraints of `schedule`, or None.

    Args:
        schedule: the `Schedule` of `options.schedule`.
        options: positive `num_stages`, `num_microbatches`, `virtual_stages`.
    """
    if options.virtual_stages > 1 and not schedule.virtual_stages:
        capable = [name for name, entry in SCHEDULES.items() if entry.virtual_stages]
        return (
            f"Invalid value for argument `virtual_stages`. Received: virtual_stages="
            f"{options.virtual_stages} with schedule={options.schedule!r}. Expected 1, or a schedule "
            f"among {capable}."
        )
    if schedule.exact_virtual_stages and options.virtual_stages != schedule.exact_virtual_stages:
        return (
            f"Invalid value for argument `virtual_stages`. Received: virtual_stages="
            f"{options.virtual_stages} with schedule={options.schedule!r}. Expected "
            f"{schedule.exact_virtual_stages} (the schedule runs {schedule.exact_virtual_stages} "
            "chunks per device)."
        )
    if schedule.rounds_of_stages and options.num_microbatches % options.num_stages:
        return (
            f"Invalid value for argument `num_microbatches`. Received: num_microbatches="
            f"{options.num_microbatches} with schedule={options.schedule!r} and num_stages="
            f"{options.num_stages}. Expected a multiple of num_stages (the schedule runs rounds of S "
            "micro-batches)."
        )
    if schedule.weight_ops and options.recompute is True:
        return (
            f"Invalid value for argument `recompute`. Received: recompute=True with "
            f"schedule={options.schedule!r}. Expected False: its W ops need each layer's kept output."
        )
    return None


def _integer(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class Rule:
    """The values an option takes, the entry of `RULES` for it.

    Attributes:
        holds: `holds(value)` is true for a valid value.
        expected: the valid values in words, as the errors end ("Expected {expected}."); a
            function of nothing where they are read from a table that may grow (`SCHEDULES`).
    """

    holds: Callable[[Any], bool]
    expected: Union[str, Callable[[], str]]

    def in_words(self):
        """`expected`, as words."""
        return self.expected() if callable(self.expected) else self.expected


def _one_of(values):
    """A `Rule` for a closed set of strings, `values()` (read when checked, so a table may grow)."""
    return Rule(lambda v: isinstance(v, str) and v in values(), lambda: f"one of {list(values())}")


_POSITIVE_INTEGER = Rule(lambda v: _integer(v) and v >= 1, "a positive integer")

# Each option's type and range, written once: the strategies check their options with
# `option_problem`, and tfscale-train's flags validate with the same `Rule` (an option left
# at a None default is "not given", which the caller handles).
RULES = {
    "num_stages": _POSITIVE_INTEGER,
    "num_microbatches": _POSITIVE_INTEGER,
    "virtual_stages": _POSITIVE_INTEGER,
    "data_parallel": _POSITIVE_INTEGER,
    "num_devices": _POSITIVE_INTEGER,
    "cpu_replicas": _POSITIVE_INTEGER,
    "num_gpus": _POSITIVE_INTEGER,
    "schedule": _one_of(lambda: SCHEDULES),
    "communication": _one_of(lambda: COMMUNICATIONS),
    "cross_device_ops": _one_of(lambda: CROSS_DEVICE_OPS),
    "gradient_compression": _one_of(lambda: GRADIENT_COMPRESSIONS),
    "zero_stage": Rule(lambda v: _integer(v) and v in ZERO_STAGES, f"an integer {in_words(ZERO_STAGES)}"),
    "bytes_per_pack": Rule(  # a whole float (64.0) too, as TensorFlow takes it
        lambda v: _number(v) and math.isfinite(v) and v >= 0 and v == int(v), "an integer >= 0 (0: one pack)"
    ),
    "timeout_seconds": Rule(lambda v: _number(v) and v > 0, "a positive number of seconds"),
    "cluster_timeout": Rule(
        lambda v: _number(v) and 0 < v < math.inf, "a positive, finite number of seconds"
    ),
    "replica_statistics": Rule(lambda v: isinstance(v, bool), "True or False"),
    "replica_random": Rule(lambda v: isinstance(v, bool), "True or False"),
}


def option_problem(option, value, argument=None):
    """Why `value` breaks the `RULES` entry of `option`, in one line, or None.

    Args:
        option: a key of `RULES`.
        value: the value given.
        argument: the name to show, where the caller's argument for `option` is named
            otherwise (e.g. `implementation` for `communication`); default `option`.
    """
    rule = RULES[option]
    if rule.holds(value):
        return None
    argument = argument or option
    return (
        f"Invalid value for argument `{argument}`. Received: {argument}={value!r}. "
        f"Expected {rule.in_words()}."
    )


def copy_devices(name, options):
    """`(option, K)`: the option that counts one model copy's devices, and K (None: the devices decide).

    Args:
        name: "pipeline" or "model_split".
        options: that strategy's options dataclass.
    """
    if name == "pipeline":
        return "num_stages", options.num_stages
    return "num_devices", options.num_devices


def microbatches(name, options):
    """M, the micro-batches each replica's batch is cut into: the pipeline's, else 1."""
    return options.num_microbatches if name == "pipeline" else 1


def expected_replicas(name, *, num_workers, cpu_replicas=None, num_gpus=None, tpu=False):
    """Replicas in sync that strategy `name` will have, or None when only TensorFlow can tell.

    "auto" is resolved by the rule `get("auto")` itself applies (`tfscale._auto`), with the
    GPUs unknown: it is answered only where they cannot change the choice.

    Args:
        name: a name in `NAMES`.
        num_workers: workers of this task's cluster (1 for a single process).
        cpu_replicas: the `cpu_replicas` option, or None.
        num_gpus: mirrored's `num_gpus` option, or None.
        tpu: a TPU is named (by the `tpu` option or the environment).
    """
    if name == "auto":
        if not cpu_replicas and num_workers == 1:
            return None  # Then the GPUs decide, and only TensorFlow can count them.
        # With cpu_replicas given, the GPU count no longer changes how many replicas there are.
        name, _ = _auto.choose(tpu=tpu, num_workers=num_workers, gpus=0, cpu_replicas=cpu_replicas)
    if name in ("one_device", "default"):
        return 1
    if name == "multi_worker":
        return num_workers * cpu_replicas if cpu_replicas else None
    if name == "mirrored":
        return cpu_replicas or num_gpus
    return None
