"""absl flags shared by every tfscale binary, their validators, and flags -> plain values.

Every `define_*` function takes the `FlagValues` to define into, so a binary uses its own
and tests use a fresh `flags.FlagValues()`. Validators run at parse time and fail with
one line naming the flag. `--flagfile` works (absl handles it); presets live in
`flagfiles/`. Nothing here imports TensorFlow, so a bad flag fails before TF starts: the
strategy flags' choices, defaults and rules are read from `tfscale._strategy_spec`, the
TensorFlow-free spec that `tfscale.strategies` builds from too.

    fv = flags.FlagValues()
    tfscale.flags.define_all(fv)
    fv(["prog", "--strategy=mirrored", "--cpu_replicas=2"])
    name, options = tfscale.flags.strategy_args(fv)   # ("mirrored", {"cpu_replicas": 2})
"""

import os

from absl import flags

from tfscale import _auto, _task_protocol
from tfscale import _strategy_spec as _spec
from tfscale import models as _models

__all__ = [
    "CLUSTER_SOURCE_FLAGS",
    "DATASET_PREFIXES",
    "MODELS",
    "MODEL_PARALLEL",
    "OPTIMIZERS",
    "SCHEDULES",
    "STRATEGIES",
    "check_flagfiles",
    "cluster_spec",
    "define_all",
    "define_cluster_flags",
    "define_cluster_source_flags",
    "define_data_flags",
    "define_fault_tolerance_flags",
    "define_model_parallel_flags",
    "define_output_flags",
    "define_performance_flags",
    "define_strategy_flags",
    "define_training_flags",
    "expected_replicas",
    "strategy_args",
]

# The strategies' names, options, defaults and rules are `tfscale._strategy_spec`'s (which
# `tfscale.strategies` reads too); these are its names, under the flags' names for them.
STRATEGIES = _spec.NAMES  # `tfscale.strategies.NAMES`
MODEL_PARALLEL = _spec.MODEL_PARALLEL  # tfscale-train splits the model for these
SCHEDULES = tuple(_spec.SCHEDULES)  # `--schedule`: `tfscale.strategies.pipeline.SCHEDULES`
# The model-parallel flags, passed as the options of the same name to the strategies that take
# them (`_spec.owners`).
_MODEL_PARALLEL_FLAGS = (
    "num_stages",
    "num_microbatches",
    "schedule",
    "virtual_stages",
    "num_devices",
    "tensor_parallel",
    "data_parallel",
)
DEFAULT_GLOBAL_BATCH_SIZE = _task_protocol.DEFAULT_GLOBAL_BATCH_SIZE
# The optimizer registry: `--optimizer` name -> class in `keras.optimizers` (train.py builds it).
OPTIMIZERS = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD", "rmsprop": "RMSprop"}
DATASET_PREFIXES = ("digits", "tfds:", "synthetic:")
MODELS = tuple(_models.MODELS)  # The registry itself, `tfscale.models.MODELS` (imports no Keras).


# A flagfile is a few lines of flags; a bigger "flagfile" is a wrong path (absl reads it whole).
_MAX_FLAGFILE_BYTES = 1 << 20
_MAX_FLAGFILE_DEPTH = 16


def check_flagfiles(argv):
    """Raises `flags.IllegalFlagValueError` (one line) for a `--flagfile` in `argv` absl mishandles.

    absl reads a flagfile whole with the locale's codec and passes on any line that is not
    a comment: `--flagfile=/dev/zero` never ends (and eats memory), bytes that are not
    UTF-8 end in a traceback, and a junk line silently becomes an argument (a command
    word, for `tfscale-launch`). Each flagfile named in `argv` (before `--`), and each
    one they include, must be a regular file of at most 1 MiB of UTF-8 text whose lines
    are flags, comments or blank.
    """
    args = list(argv[1:])
    for i, arg in enumerate(args):
        if arg == "--":
            break
        if arg in ("--flagfile", "-flagfile") and i + 1 < len(args):
            _check_flagfile(os.path.expanduser(args[i + 1]), [])
        elif arg.startswith(("--flagfile=", "-flagfile=")):
            _check_flagfile(os.path.expanduser(arg.split("=", 1)[1]), [])


def _flagfile_error(path, problem, expected="a readable file of --flag=value lines"):
    return flags.IllegalFlagValueError(f"--flagfile={path!r} {problem}. Expected {expected}.")


def _check_flagfile(path, stack):
    import stat

    if path in stack or len(stack) >= _MAX_FLAGFILE_DEPTH:
        raise _flagfile_error(path, f"is included again through {stack[-1]!r}", "flagfiles that do not loop")
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise _flagfile_error(path, "is not a regular file (a folder, a device or a pipe)")
        if info.st_size > _MAX_FLAGFILE_BYTES:
            raise _flagfile_error(path, f"holds {info.st_size} bytes", f"at most {_MAX_FLAGFILE_BYTES} bytes")
        with open(path, "rb") as f:
            data = f.read(_MAX_FLAGFILE_BYTES + 1)
    except OSError as e:
        raise _flagfile_error(path, f"cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _flagfile_error(path, f"is not UTF-8 text (byte {e.start})", "UTF-8 text") from None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith(("#", "//")):
            continue
        if line.startswith(("--flagfile=", "-flagfile=")):
            nested = os.path.expanduser(line.split("=", 1)[1])
            _check_flagfile(nested, [*stack, path])
        elif not line.startswith("-"):
            raise _flagfile_error(
                path, f"line {number} is not a flag: {line[:80]!r}", "--flag=value lines, comments, blanks"
            )


def _positive_or_none(value):
    return value is None or value > 0


def _check_as_option(fv, *names):
    """Validates each `--name` by the spec's rule for the strategy option of that name.

    The rule (`tfscale._strategy_spec.RULES`) is the one `tfscale.strategies` checks the
    option with; unset (None) means the strategy's default.
    """
    for name in names:
        rule = _spec.RULES[name]
        flags.register_validator(
            name,
            lambda v, rule=rule: v is None or rule.holds(v),
            f"--{name} expects {rule.in_words()}.",
            flag_values=fv,
        )


def define_strategy_flags(fv):
    """--strategy, --cpu_replicas, --num_gpus, --cross_device_ops, --communication, --tpu."""
    flags.DEFINE_enum("strategy", "auto", STRATEGIES, "Distribution strategy.", flag_values=fv)
    flags.DEFINE_integer(
        "cpu_replicas",
        None,
        "Split the host CPU into N logical devices (replicas) per worker.",
        flag_values=fv,
    )
    flags.DEFINE_integer("num_gpus", None, "GPUs per worker for --strategy=mirrored.", flag_values=fv)
    flags.DEFINE_enum(
        "cross_device_ops",
        None,
        _spec.CROSS_DEVICE_OPS,
        "All-reduce of --strategy=mirrored.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "communication",
        _spec.MultiWorkerOptions.communication,
        _spec.COMMUNICATIONS,
        "Collectives of multi_worker.",
        flag_values=fv,
    )
    flags.DEFINE_string("tpu", None, "TPU name or grpc:// address for --strategy=tpu.", flag_values=fv)
    flags.DEFINE_enum(
        "gradient_compression",
        None,
        _spec.GRADIENT_COMPRESSIONS,
        "Gradient all-reduce dtype for mirrored / multi_worker (cast back after it).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "bytes_per_pack", None, "Gradient all-reduce pack size in bytes (0: one pack).", flag_values=fv
    )
    flags.DEFINE_integer(
        "zero_stage",
        None,
        "ZeRO stage for --strategy=mirrored: 1 shards optimizer slots over the replicas, 2 also "
        "gradient accumulators (tfscale.strategies.get's zero_stage).",
        flag_values=fv,
    )
    _check_as_option(fv, "cpu_replicas", "num_gpus", "bytes_per_pack", "zero_stage")
    flags.mark_flags_as_mutual_exclusive(["cpu_replicas", "num_gpus"], flag_values=fv)


def _tf_config_text(value):
    """The TF_CONFIG JSON of `--tf_config`: the value itself, or the file it names (read once, here)."""
    from tfscale.cluster import ClusterSpecError

    if value.lstrip().startswith("{"):
        return value
    from tfscale._hosts import read_text_file

    try:
        return read_text_file(value)  # bounded: --tf_config=/dev/zero must not read forever
    except (OSError, ValueError) as e:
        raise ClusterSpecError(
            f"--tf_config={value!r} is neither JSON nor an existing file "
            f"({getattr(e, 'strerror', None) or e}). Expected TF_CONFIG JSON or the path of a file "
            "holding it."
        ) from None


def _cluster_of(tf_config, environ):
    """The `ClusterSpec` of `--tf_config`, else of `$TF_CONFIG` in `environ`, else `local()`."""
    from tfscale.cluster import ClusterSpec

    if tf_config is None:
        return ClusterSpec.from_env(environ, allow_unset=True)
    return ClusterSpec.from_tf_config(_tf_config_text(tf_config))


def _valid_tf_config(value):
    from tfscale.cluster import ClusterSpecError

    if value is None:
        return True
    try:
        text = _tf_config_text(value)
    except ClusterSpecError as e:
        raise flags.ValidationError(str(e)) from None
    try:
        _cluster_of(text, {})
    except ClusterSpecError as e:
        raise flags.ValidationError(f"--tf_config: {e}") from None
    return True


def define_cluster_flags(fv):
    """--tf_config: the cluster as TF_CONFIG JSON (or a file holding it); default $TF_CONFIG."""
    flags.DEFINE_string(
        "tf_config",
        None,
        "TF_CONFIG JSON, or a path to a file holding it. Default: $TF_CONFIG.",
        flag_values=fv,
    )
    flags.register_validator("tf_config", _valid_tf_config, flag_values=fv)
    flags.DEFINE_float(
        "cluster_timeout",
        _spec.DEFAULT_CLUSTER_TIMEOUT,
        "Seconds a worker waits for every peer of the cluster to start before it fails naming "
        "the missing tasks (exit 1).",
        flag_values=fv,
    )
    _check_as_option(fv, "cluster_timeout")


class _TaskPlacementParser(flags.ArgumentParser):
    """`--chief` / `--evaluator`: bare (or true/false) switches the task on or off; `=HOST` places it."""

    syntactic_help = "bare, true/false, or a host[:port]"

    def parse(self, argument):
        if isinstance(argument, bool) or argument is None:
            return argument
        text = str(argument).strip()
        if text.lower() in ("true", "t", "1", "yes"):
            return True
        if text.lower() in ("false", "f", "0", "no"):
            return False
        if not text or "," in text:
            raise ValueError(f"expected one host[:port] or true/false, received {argument!r}")
        return text

    def flag_type(self):
        return "bool or host"


class _TaskPlacementFlag(flags.Flag):
    def __init__(self, name, help_text):
        super().__init__(_TaskPlacementParser(), None, name, False, help_text)
        self.boolean = True  # `--chief` alone means true, as it always did for the launcher.

    def _serialize(self, value):
        if isinstance(value, str):
            return f"--{self.name}={value}"
        return super()._serialize(value)


# The cluster-source flags, one definition each, shared by `tfscale-launch` and
# `tfscale-tfconfig` (each binary defines the ones it takes). One meaning per name:
# `--hosts` lists worker hosts (`--workers` is its alias); `--chief` / `--evaluator` add
# that task, bare on the first host (this host for a local job) or `=HOST` on HOST.
_CLUSTER_SOURCE_FLAGS = {
    "hosts": lambda fv: (
        flags.DEFINE_list(
            "hosts",
            None,
            "Worker hosts: host, host:port (1024-65535) or host:slots (1-1023). Alias: --workers.",
            flag_values=fv,
        ),
        flags.DEFINE_alias("workers", "hosts", flag_values=fv),
    ),
    "hostfile": lambda fv: flags.DEFINE_string(
        "hostfile",
        None,
        "File of 'host slots=N' lines (MPI/DeepSpeed style), instead of --hosts.",
        flag_values=fv,
    ),
    "port": lambda fv: flags.DEFINE_integer(
        "port",
        2222,
        "Base port: the first port on each host.",
        lower_bound=1,
        upper_bound=65535,
        flag_values=fv,
    ),
    "chief": lambda fv: flags.DEFINE_flag(
        _TaskPlacementFlag("chief", "Add a chief task: bare on the first host, or --chief=HOST[:PORT]."), fv
    ),
    "evaluator": lambda fv: flags.DEFINE_flag(
        _TaskPlacementFlag(
            "evaluator", "Add an evaluator task: bare on a host in turn, or --evaluator=HOST[:PORT]."
        ),
        fv,
    ),
    "ps": lambda fv: flags.DEFINE_list("ps", [], "Parameter-server hosts, like --hosts.", flag_values=fv),
    "num_ps": lambda fv: flags.DEFINE_integer(
        "num_ps",
        0,
        "Parameter-server tasks, on the hosts in turn (needs --chief).",
        lower_bound=0,
        flag_values=fv,
    ),
}
CLUSTER_SOURCE_FLAGS = tuple(_CLUSTER_SOURCE_FLAGS)


def define_cluster_source_flags(fv, names=CLUSTER_SOURCE_FLAGS):
    """Defines the cluster-source flags `names` (a subset of `CLUSTER_SOURCE_FLAGS`) in `fv`."""
    for name in names:
        _CLUSTER_SOURCE_FLAGS[name](fv)


def _valid_dataset(value):
    if value == "digits" or any(value.startswith(p) and len(value) > len(p) for p in DATASET_PREFIXES[1:]):
        return True
    raise flags.ValidationError(
        f"--dataset={value!r} is unknown. Expected 'digits', 'tfds:NAME[/CONFIG][:VERSION]' or "
        "'synthetic:...'."
    )


def _utf8(text):
    try:
        text.encode("utf-8")  # an argv byte that is not UTF-8 arrives as a lone surrogate
    except UnicodeEncodeError:
        return False
    return True


def _valid_data_dir(value):
    if value is not None and not _utf8(value):
        raise flags.ValidationError(
            f"--data_dir={value!r} holds bytes that are not UTF-8. Expected a UTF-8 path (TensorFlow's "
            "file functions take no other)."
        )
    if value is None or os.path.isdir(value):
        return True
    raise flags.ValidationError(f"--data_dir={value!r} does not exist. Expected an existing folder.")


def _valid_batch(values):
    if values["global_batch_size"] is not None and values["per_replica_batch_size"] is not None:
        raise flags.ValidationError("--global_batch_size and --per_replica_batch_size exclude each other.")
    return True


def define_data_flags(fv):
    """--dataset, --data_dir, --global_batch_size / --per_replica_batch_size, --shuffle_buffer, --seed."""
    flags.DEFINE_string(
        "dataset",
        "digits",
        "'digits' (bundled), 'tfds:NAME[/CONFIG][:VERSION]' or 'synthetic:...'.",
        flag_values=fv,
    )
    flags.DEFINE_string("data_dir", None, "Folder of prepared TFDS datasets (must exist).", flag_values=fv)
    flags.DEFINE_integer(
        "global_batch_size",
        None,
        f"Examples per step over all replicas (default {DEFAULT_GLOBAL_BATCH_SIZE}).",
        flag_values=fv,
    )
    flags.DEFINE_integer("per_replica_batch_size", None, "Examples per step per replica.", flag_values=fv)
    flags.DEFINE_integer(
        "shuffle_buffer", None, "Shuffle buffer (default: whole split if cached).", flag_values=fv
    )
    flags.DEFINE_integer("seed", 0, "Seed of weights and shuffling (same on every worker).", flag_values=fv)
    flags.DEFINE_enum(
        "sharding", "auto", ["auto", "data", "files"], "Per-worker input sharding.", flag_values=fv
    )
    flags.register_validator("dataset", _valid_dataset, flag_values=fv)
    flags.register_validator(
        "seed", lambda v: 0 <= v < 2**32, "--seed expects an integer in 0-4294967295.", flag_values=fv
    )
    flags.register_validator("data_dir", _valid_data_dir, flag_values=fv)
    for name in ("global_batch_size", "per_replica_batch_size", "shuffle_buffer"):
        flags.register_validator(
            name, _positive_or_none, f"--{name} expects a positive integer.", flag_values=fv
        )
    flags.register_multi_flags_validator(
        ["global_batch_size", "per_replica_batch_size"], _valid_batch, flag_values=fv
    )


def _valid_model(value):
    module, sep, attr = value.partition(":")
    if value in MODELS or (sep and module and attr):
        return True
    raise flags.ValidationError(
        f"--model={value!r} is unknown. Expected one of {list(MODELS)} or 'module.path:factory'."
    )


def define_training_flags(fv):
    """--model, --epochs, --steps_per_epoch, --learning_rate, --optimizer, --lr_warmup_epochs, ..."""
    flags.DEFINE_string(
        "model", "mlp", "'mlp', 'cnn', 'transformer', or 'module.path:factory' of your own.", flag_values=fv
    )
    flags.DEFINE_integer("epochs", 10, "Training epochs.", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("steps_per_epoch", None, "Steps per epoch (default: one pass).", flag_values=fv)
    flags.DEFINE_float(
        "learning_rate", 0.003, "Learning rate (per replica with --lr_scaling=linear).", flag_values=fv
    )
    flags.DEFINE_enum("optimizer", "adam", list(OPTIMIZERS), "Optimizer.", flag_values=fv)
    flags.DEFINE_float(
        "lr_warmup_epochs", 0.0, "Linear warmup, per step, over this many epochs.", flag_values=fv
    )
    flags.DEFINE_enum(
        "lr_scaling",
        "none",
        ["none", "linear"],
        "'linear': lr x replicas (Goyal et al. 2017).",
        flag_values=fv,
    )
    flags.register_validator("model", _valid_model, flag_values=fv)
    flags.register_validator(
        "steps_per_epoch", _positive_or_none, "--steps_per_epoch expects a positive integer.", flag_values=fv
    )
    flags.register_validator(
        "learning_rate",
        lambda v: 0 < v < float("inf"),
        "--learning_rate expects a positive, finite number.",
        flag_values=fv,
    )
    flags.register_validator(
        "lr_warmup_epochs",
        lambda v: 0 <= v < float("inf"),
        "--lr_warmup_epochs expects a finite number >= 0.",
        flag_values=fv,
    )


def define_performance_flags(fv):
    """--mixed_precision, --jit_compile, --steps_per_execution."""
    flags.DEFINE_enum(
        "mixed_precision",
        "float32",
        ["float32", "mixed_float16", "mixed_bfloat16"],
        "Keras dtype policy.",
        flag_values=fv,
    )
    flags.DEFINE_boolean("jit_compile", False, "Compile the train step with XLA.", flag_values=fv)
    flags.DEFINE_integer(
        "steps_per_execution", 1, "Steps per tf.function call.", lower_bound=1, flag_values=fv
    )


def _several_tasks():
    from tfscale.cluster import ClusterSpec, ClusterSpecError

    try:
        return ClusterSpec.from_env(allow_unset=True).task_count > 1
    except ClusterSpecError:
        return False  # Reported by the --tf_config / TF_CONFIG checks, in their words.


def _valid_model_parallel(values):
    """Model-parallel flags fit their strategy, the devices and the batch (one line naming them)."""
    strategy = values["strategy"]
    given = {name: values[name] for name in _MODEL_PARALLEL_FLAGS if values[name] not in (None, False)}
    for name in given:
        owners = _spec.owners(name)
        if strategy not in owners:
            raise flags.ValidationError(
                f"--{name} applies to --strategy={'|'.join(owners)}, not --strategy={strategy}."
            )
    if values["plan_report"] and strategy != "pipeline":
        raise flags.ValidationError(
            f"--plan_report applies to --strategy=pipeline, not --strategy={strategy}."
        )
    if strategy not in MODEL_PARALLEL:
        return True
    options = _spec.OPTIONS[strategy](**given)  # the strategy's defaults where a flag is unset
    if strategy == "pipeline":
        problem = _spec.schedule_problem(_spec.SCHEDULES[options.schedule], options)
        if problem:
            raise flags.ValidationError(f"--schedule={options.schedule}: {problem}")
    d = options.data_parallel
    # model_split: K unknown here without --num_devices (then the devices decide)
    count, per_copy = _spec.copy_devices(strategy, options)
    cpus = values["cpu_replicas"]
    # In a cluster of several tasks each serves its --cpu_replicas devices: the strategy checks
    # D x S against all of them once connected (one line too).
    if cpus and per_copy and d * per_copy > cpus and not _several_tasks():
        raise flags.ValidationError(
            f"--data_parallel={d} x --{count}={per_copy} needs {d * per_copy} devices, more than "
            f"--cpu_replicas={cpus}. Expected data_parallel x {count} <= {cpus}."
        )
    per_replica = values["per_replica_batch_size"]
    batch = values["global_batch_size"] or (per_replica * d if per_replica else DEFAULT_GLOBAL_BATCH_SIZE)
    if batch % d:
        raise flags.ValidationError(
            f"--global_batch_size={batch} is not divisible by --data_parallel={d}. "
            f"Expected a multiple of {d}."
        )
    m = _spec.microbatches(strategy, options)
    if (batch // d) % m:
        raise flags.ValidationError(
            f"--num_microbatches={m} does not divide the per-replica batch of {batch // d} "
            f"(--global_batch_size={batch} / --data_parallel={d}). Expected a divisor of {batch // d}."
        )
    return True


def define_model_parallel_flags(fv):
    """The pipeline's and model split's flags, passed to `strategies.get` as the same options.

    --num_stages, --num_microbatches, --schedule, --virtual_stages (pipeline); --num_devices,
    --tensor_parallel (model_split); --data_parallel (both); --plan_report (pipeline: print the
    planning report).
    """
    # Unset (None) means the strategy's default, stated in the help from the spec.
    pipeline = _spec.OPTIONS["pipeline"]()
    flags.DEFINE_integer(
        "num_stages", None, f"Pipeline stages S (default {pipeline.num_stages}).", flag_values=fv
    )
    flags.DEFINE_integer(
        "num_microbatches",
        None,
        f"Pipeline micro-batches M per replica's batch (default {pipeline.num_microbatches}).",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "schedule", None, SCHEDULES, f"Pipeline schedule (default {pipeline.schedule}).", flag_values=fv
    )
    flags.DEFINE_integer(
        "virtual_stages",
        None,
        f"Pipeline chunks V per device: interleaved, and 2 for zb-v (default {pipeline.virtual_stages}).",
        flag_values=fv,
    )
    flags.DEFINE_integer("num_devices", None, "Model split: devices K of one copy.", flag_values=fv)
    flags.DEFINE_boolean(
        "tensor_parallel",
        False,
        "Model split: split within layers (tensor split) over the K devices.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "data_parallel",
        None,
        "D copies of the pipeline / split model, each on its own devices and 1/D of every batch.",
        flag_values=fv,
    )
    flags.DEFINE_boolean(
        "plan_report",
        False,
        "Print the per-device memory and per-step traffic report of the split model at start.",
        flag_values=fv,
    )
    _check_as_option(fv, "num_stages", "num_microbatches", "virtual_stages", "num_devices", "data_parallel")


def _valid_backup_freq(value):
    # ASCII only: str.isdigit() also takes '²', which int() refuses (a traceback later). At most
    # 18 digits: int() refuses strings of over 4300 digits, and no run has more steps anyway.
    if value == "epoch" or (value.isascii() and value.isdigit() and len(value) <= 18 and int(value) > 0):
        return True
    raise flags.ValidationError(
        f"--backup_freq={value!r}. Expected 'epoch' or a positive number of steps (ASCII digits)."
    )


def _output_dir_problem(path):
    """Why tfscale could not create and write the folder `path`, or None."""
    if not path.strip() or not _utf8(path):
        # TensorFlow's file functions take UTF-8 paths only (a lone surrogate: an undecodable byte).
        return "is empty" if not path.strip() else "holds bytes that are not UTF-8"
    probe = os.path.abspath(path)
    try:
        try:
            os.stat(probe)  # a too long or undecodable name fails here, even when missing
        except FileNotFoundError:
            pass
        while not os.path.lexists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe):
            return "is a file" if probe == os.path.abspath(path) else f"is under the file {probe!r}"
        if not os.access(probe, os.W_OK | os.X_OK):  # also false on a read-only mount, for root
            return f"cannot be written ({probe!r} is read-only)"
        if os.statvfs(probe).f_bavail == 0:
            return f"is on a full file system ({probe!r})"
    except (OSError, ValueError) as e:
        return f"cannot be used ({getattr(e, 'strerror', None) or e})"
    return None


def _valid_output_dir(name):
    """Validator of `--name`, a folder tfscale writes: checked before TensorFlow starts."""

    def check(value):
        problem = None if value is None else _output_dir_problem(value)
        if problem:
            raise flags.ValidationError(f"--{name}={value!r} {problem}. Expected a folder tfscale can write.")
        return True

    return check


def define_fault_tolerance_flags(fv):
    """--backup_dir, --backup_freq, --backup_async (and the hidden --fail_at_step for chaos tests)."""
    flags.DEFINE_string("backup_dir", None, "Back up training state here; resume from it.", flag_values=fv)
    flags.DEFINE_string("backup_freq", "epoch", "'epoch' or a number of steps.", flag_values=fv)
    flags.DEFINE_boolean(
        "backup_async",
        False,
        "Write backups on a background thread (BackupAndRestore's async_save): the step pays "
        "only a copy of the state; with a number of steps, a kill still loses at most that many.",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "fail_at_step", None, "Chaos testing: kill this process at this global step.", flag_values=fv
    )
    flags.register_validator("backup_freq", _valid_backup_freq, flag_values=fv)
    flags.register_validator("backup_dir", _valid_output_dir("backup_dir"), flag_values=fv)
    flags.register_validator(
        "fail_at_step", _positive_or_none, "--fail_at_step expects a positive integer.", flag_values=fv
    )


def parse_profile_steps(value):
    """`"A:B"` -> `(A, B)`, the 1-based steps `--profile_steps` profiles; None stays None."""
    if value is None:
        return None
    first, sep, last = value.partition(":")
    if sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise flags.ValidationError(f"--profile_steps={value!r}. Expected A:B, whole numbers with 1 <= A <= B.")


def define_output_flags(fv):
    """--model_dir: TensorBoard logs, the final model and summary (chief only); --profile_steps."""
    flags.DEFINE_string(
        "model_dir", None, "TensorBoard logs and the final model (written by the chief only).", flag_values=fv
    )
    flags.DEFINE_string(
        "profile_steps",
        None,
        "A:B: profile steps A..B of this run (1-based) on every worker with CommunicationProfiler: "
        "input/compute/all-reduce JSON and Chrome trace per worker, PNG on the chief, under "
        "<model_dir>/profile (./tfscale_profile without --model_dir). Not profiled: no overhead.",
        flag_values=fv,
    )
    flags.register_validator("profile_steps", lambda v: parse_profile_steps(v) or True, flag_values=fv)
    flags.register_validator("model_dir", _valid_output_dir("model_dir"), flag_values=fv)


def expected_replicas(values, environ=None):
    """Replicas in sync implied by the strategy flags alone, or None when only TensorFlow can tell.

    Lets a batch size that cannot be split fail at parse time, before TensorFlow starts.
    The flags give the cluster and the options; the prediction is the spec's
    (`tfscale._strategy_spec.expected_replicas`: "auto" by the rule `strategies.get("auto")`
    itself applies).
    """
    from tfscale.cluster import ClusterSpecError

    environ = os.environ if environ is None else environ
    try:
        workers = _cluster_of(values["tf_config"], environ).num_workers
    except ClusterSpecError:
        return None  # Reported by the --tf_config validator or when the strategy is built.
    return _spec.expected_replicas(
        values["strategy"],
        num_workers=workers,
        cpu_replicas=values["cpu_replicas"],
        num_gpus=values["num_gpus"],
        tpu=_auto.tpu_named(values.get("tpu"), environ),
    )


def _valid_batch_split(values):
    replicas = expected_replicas(values)
    batch = values["global_batch_size"]
    if replicas and batch and batch % replicas:
        raise flags.ValidationError(
            f"--global_batch_size={batch} is not divisible by the {replicas} replicas of "
            f"--strategy={values['strategy']}. Expected a multiple of {replicas}."
        )
    return True


def define_all(fv):
    """Defines every tfscale flag in `fv`."""
    for define in (
        define_strategy_flags,
        define_cluster_flags,
        define_data_flags,
        define_training_flags,
        define_performance_flags,
        define_fault_tolerance_flags,
        define_output_flags,
        define_model_parallel_flags,
    ):
        define(fv)
    flags.register_multi_flags_validator(
        [
            "strategy",
            "cpu_replicas",
            "global_batch_size",
            "per_replica_batch_size",
            "plan_report",
            *_MODEL_PARALLEL_FLAGS,
        ],
        _valid_model_parallel,
        flag_values=fv,
    )
    flags.register_multi_flags_validator(
        ["strategy", "cpu_replicas", "num_gpus", "tpu", "tf_config", "global_batch_size"],
        _valid_batch_split,
        flag_values=fv,
    )


def strategy_args(fv):
    """Returns `(name, options)` for `tfscale.strategies.get` from the strategy flags.

    Only options the user set are passed, so `strategies.get` reports any that do not
    apply to the chosen strategy (e.g. `--tpu` with `--strategy=mirrored`).
    """
    options = {}
    for flag, option in (
        ("cpu_replicas", "cpu_replicas"),
        ("num_gpus", "num_gpus"),
        ("cross_device_ops", "cross_device_ops"),
        ("tpu", "tpu"),
        ("gradient_compression", "gradient_compression"),
        ("bytes_per_pack", "bytes_per_pack"),
        ("zero_stage", "zero_stage"),
    ):
        if fv[flag].value is not None:
            options[option] = fv[flag].value
    for name in _MODEL_PARALLEL_FLAGS:
        if name in fv and fv[name].value not in (None, False):
            options[name] = fv[name].value
    if fv["communication"].present:
        options["communication"] = fv.communication
    if (
        "cluster_timeout" in fv
        and fv["cluster_timeout"].present
        and fv.strategy
        in (
            "auto",
            "multi_worker",
            *MODEL_PARALLEL,  # across tasks: how long to wait for them (tfscale.strategies.connect_cluster)
        )
    ):
        options["cluster_timeout"] = fv.cluster_timeout
    return fv.strategy, options


def cluster_spec(fv, environ=None):
    """The `ClusterSpec` of `--tf_config`, else of `$TF_CONFIG`, else None (single process)."""
    spec = _cluster_of(fv.tf_config, os.environ if environ is None else environ)
    return None if spec.is_local else spec
