"""absl flags shared by every tfscale binary, their validators, and flags -> plain values.

Every `define_*` function takes the `FlagValues` to define into, so a binary uses its own
and tests use a fresh `flags.FlagValues()`. Validators run at parse time and fail with
one line naming the flag. `--flagfile` works (absl handles it); presets live in
`flagfiles/`. Nothing here imports TensorFlow, so a bad flag fails before TF starts.

    fv = flags.FlagValues()
    tfscale.flags.define_all(fv)
    fv(["prog", "--strategy=mirrored", "--cpu_replicas=2"])
    name, options = tfscale.flags.strategy_args(fv)   # ("mirrored", {"cpu_replicas": 2})
"""

import os

from absl import flags

__all__ = [
    "DATASET_PREFIXES",
    "MODELS",
    "OPTIMIZERS",
    "STRATEGIES",
    "cluster_spec",
    "define_all",
    "define_cluster_flags",
    "define_data_flags",
    "define_fault_tolerance_flags",
    "define_output_flags",
    "define_performance_flags",
    "define_strategy_flags",
    "define_training_flags",
    "expected_replicas",
    "strategy_args",
]

# Strategies a data-parallel binary can run (pipeline / model_split need a split model).
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker", "tpu")
OPTIMIZERS = ("adam", "adamw", "sgd", "rmsprop")
DATASET_PREFIXES = ("digits", "tfds:", "synthetic:")
MODELS = ("mlp", "cnn", "transformer")  # tfscale.models.MODELS, named here without importing Keras.


def _positive_or_none(value):
    return value is None or value > 0


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
        ["nccl", "hierarchical_copy", "reduction_to_one_device"],
        "All-reduce of --strategy=mirrored.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "communication", "auto", ["auto", "ring", "nccl"], "Collectives of multi_worker.", flag_values=fv
    )
    flags.DEFINE_string("tpu", None, "TPU name or grpc:// address for --strategy=tpu.", flag_values=fv)
    flags.DEFINE_enum(
        "gradient_compression",
        None,
        ["fp16", "bf16"],
        "Gradient all-reduce dtype for mirrored / multi_worker (cast back after it).",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "bytes_per_pack", None, "Gradient all-reduce pack size in bytes (0: one pack).", flag_values=fv
    )
    flags.register_validator(
        "bytes_per_pack",
        lambda v: v is None or v >= 0,
        "--bytes_per_pack expects an integer >= 0.",
        flag_values=fv,
    )
    for name in ("cpu_replicas", "num_gpus"):
        flags.register_validator(
            name, _positive_or_none, f"--{name} expects a positive integer.", flag_values=fv
        )
    flags.mark_flags_as_mutual_exclusive(["cpu_replicas", "num_gpus"], flag_values=fv)


def _valid_tf_config(value):
    if value is None:
        return True
    from tfscale.cluster import ClusterSpec, ClusterSpecError

    text = value
    if not value.lstrip().startswith("{"):
        if not os.path.isfile(value):
            raise flags.ValidationError(f"--tf_config={value!r} is neither JSON nor an existing file.")
        with open(value) as f:
            text = f.read()
    try:
        ClusterSpec.from_tf_config(text)
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


def _valid_dataset(value):
    if value == "digits" or any(value.startswith(p) and len(value) > len(p) for p in DATASET_PREFIXES[1:]):
        return True
    raise flags.ValidationError(
        f"--dataset={value!r} is unknown. Expected 'digits', 'tfds:NAME[/CONFIG][:VERSION]' or "
        "'synthetic:...'."
    )


def _valid_data_dir(value):
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
        "global_batch_size", None, "Examples per step over all replicas (default 64).", flag_values=fv
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
    flags.DEFINE_enum("optimizer", "adam", OPTIMIZERS, "Optimizer.", flag_values=fv)
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
        "learning_rate", lambda v: v > 0, "--learning_rate expects a positive number.", flag_values=fv
    )
    flags.register_validator(
        "lr_warmup_epochs", lambda v: v >= 0, "--lr_warmup_epochs expects a number >= 0.", flag_values=fv
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


def _valid_backup_freq(value):
    if value == "epoch" or (value.isdigit() and int(value) > 0):
        return True
    raise flags.ValidationError(f"--backup_freq={value!r}. Expected 'epoch' or a positive number of steps.")


def define_fault_tolerance_flags(fv):
    """--backup_dir, --backup_freq (and the hidden --fail_at_step for chaos tests)."""
    flags.DEFINE_string("backup_dir", None, "Back up training state here; resume from it.", flag_values=fv)
    flags.DEFINE_string("backup_freq", "epoch", "'epoch' or a number of steps.", flag_values=fv)
    flags.DEFINE_integer(
        "fail_at_step", None, "Chaos testing: kill this process at this global step.", flag_values=fv
    )
    flags.register_validator("backup_freq", _valid_backup_freq, flag_values=fv)
    flags.register_validator(
        "fail_at_step", _positive_or_none, "--fail_at_step expects a positive integer.", flag_values=fv
    )


def define_output_flags(fv):
    """--model_dir: TensorBoard logs, the final model and summary (chief only)."""
    flags.DEFINE_string(
        "model_dir", None, "TensorBoard logs and the final model (written by the chief only).", flag_values=fv
    )


def _flag_cluster_workers(tf_config, environ):
    from tfscale.cluster import ClusterSpec, ClusterSpecError

    text = tf_config
    if text is not None and not text.lstrip().startswith("{"):
        with open(text) as f:
            text = f.read()
    text = text if text is not None else environ.get("TF_CONFIG", "")
    try:
        return ClusterSpec.from_tf_config(text).num_workers if text.strip() else 1
    except ClusterSpecError:
        return None  # Reported by the --tf_config validator or when the strategy is built.


def expected_replicas(values, environ=None):
    """Replicas in sync implied by the strategy flags alone, or None when only TensorFlow can tell.

    Lets a batch size that cannot be split fail at parse time, before TensorFlow starts.
    """
    environ = os.environ if environ is None else environ
    strategy, cpus, gpus = values["strategy"], values["cpu_replicas"], values["num_gpus"]
    workers = _flag_cluster_workers(values["tf_config"], environ)
    if strategy in ("one_device", "default"):
        return 1
    if strategy == "multi_worker" or (strategy == "auto" and workers and workers > 1):
        return workers * cpus if workers and cpus else None
    if strategy in ("mirrored", "auto"):
        return cpus or gpus
    return None


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
    ):
        define(fv)
    flags.register_multi_flags_validator(
        ["strategy", "cpu_replicas", "num_gpus", "tf_config", "global_batch_size"],
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
    ):
        if fv[flag].value is not None:
            options[option] = fv[flag].value
    if fv["communication"].present:
        options["communication"] = fv.communication
    return fv.strategy, options


def cluster_spec(fv, environ=None):
    """The `ClusterSpec` of `--tf_config`, else of `$TF_CONFIG`, else None (single process)."""
    from tfscale.cluster import ClusterSpec

    value = fv.tf_config
    if value is None:
        environ = os.environ if environ is None else environ
        return ClusterSpec.from_env(environ) if environ.get("TF_CONFIG", "").strip() else None
    if not value.lstrip().startswith("{"):
        with open(value) as f:
            value = f.read()
    return ClusterSpec.from_tf_config(value)
