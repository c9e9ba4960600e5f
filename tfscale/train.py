"""`tfscale-train`: flags -> cluster -> strategy -> dataset -> model -> `fit` -> evaluate -> save.

    tfscale-train                                   # bundled digits, MLP, strategy "auto"
    tfscale-train --flagfile=flagfiles/mirrored.cfg # 2 replicas over logical CPUs
    tfscale-launch --num_workers 2 -- tfscale-train --flagfile=flagfiles/multi_worker.cfg

Core: `train(TrainConfig(...)) -> TrainResult` takes plain values; `config_from_flags`
is the only reader of absl flags; `run()` is the console script. Only the chief writes
files (TensorBoard logs, `model.keras`, `summary.json` under `--model_dir`); every
process prints its summary, the last line as `tfscale-train-result: {json}`.
"""

import dataclasses
import importlib.util
import json
import logging
import os
import sys
import time
from typing import Any, Optional

from absl import flags

from tfscale import _quiet, _task_protocol, errors
from tfscale import flags as tfscale_flags
from tfscale.errors import Error

__all__ = [
    "RESULT_PREFIX",
    "TrainConfig",
    "TrainError",
    "TrainResult",
    "config_from_flags",
    "main",
    "parse",
    "run",
    "train",
]

RESULT_PREFIX = "tfscale-train-result: "
DEFAULT_GLOBAL_BATCH_SIZE = tfscale_flags.DEFAULT_GLOBAL_BATCH_SIZE
_log = logging.getLogger("tfscale")


class TrainError(Error):
    """A training option that cannot be honoured (names the value and what was expected)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything `train` needs, as plain values (the flags of the same names)."""

    strategy: str = "auto"
    strategy_options: Any = dataclasses.field(default_factory=dict)
    cluster: Any = None  # a tfscale.cluster.ClusterSpec; None: $TF_CONFIG, else one process
    dataset: str = "digits"
    data_dir: Optional[str] = None
    global_batch_size: Optional[int] = None
    per_replica_batch_size: Optional[int] = None
    shuffle_buffer: Optional[int] = None
    seed: int = 0
    sharding: str = "auto"
    model: str = "mlp"
    epochs: int = 10
    steps_per_epoch: Optional[int] = None
    learning_rate: float = 0.003
    optimizer: str = "adam"
    lr_warmup_epochs: float = 0.0
    lr_scaling: str = "none"
    mixed_precision: str = "float32"
    jit_compile: bool = False
    steps_per_execution: int = 1
    backup_dir: Optional[str] = None
    backup_freq: Any = "epoch"
    backup_async: bool = False
    fail_at_step: Optional[int] = None
    model_dir: Optional[str] = None
    plan_report: bool = False
    profile_steps: Optional[str] = None  # "A:B", checked by tfscale.flags.parse_profile_steps
    verbose: int = 2


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a training run did (what `run` prints)."""

    strategy: str
    num_replicas: int
    num_workers: int
    task: str
    is_chief: bool
    global_batch_size: int
    sharding: str
    epochs: int
    steps_per_epoch: int
    seconds: float
    examples_per_sec: Optional[float]
    history: dict
    evaluation: dict
    model_path: Optional[str]
    resumed_at_step: int = 0  # global step of the backup this run resumed from (0: a fresh start)

    def to_json(self):
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def config_from_flags(fv):
    """The thin adapter: a `TrainConfig` from parsed flags `fv`."""
    name, options = tfscale_flags.strategy_args(fv)
    freq = fv.backup_freq
    return TrainConfig(
        strategy=name,
        strategy_options=options,
        cluster=tfscale_flags.cluster_spec(fv),
        **{
            f.name: fv[f.name].value
            for f in dataclasses.fields(TrainConfig)
            if f.name not in ("strategy", "strategy_options", "cluster", "backup_freq", "verbose")
        },
        backup_freq=int(freq) if freq.isdigit() else freq,
    )


def _cluster(config):
    from tfscale.cluster import ClusterSpec

    return config.cluster if config.cluster is not None else ClusterSpec.from_env(allow_unset=True)


def _global_batch(config, replicas):
    if config.per_replica_batch_size is not None:
        return config.per_replica_batch_size * replicas
    return config.global_batch_size or DEFAULT_GLOBAL_BATCH_SIZE


def _eval_dataset(config, strategy, global_batch):
    import tfscale.datasets

    for split in ("test", "validation"):
        try:
            return tfscale.datasets.load(
                config.dataset,
                split,
                global_batch,
                strategy,
                data_dir=config.data_dir,
                sharding=config.sharding,
            ), split
        except tfscale.datasets.UnknownSplitError:
            continue  # Try the next split name; any other DatasetError is the user's to see.
    return None, None


def _datasets(config, strategy, global_batch):
    """(train dataset, its DatasetInfo, evaluation dataset or None, its split name)."""
    import tfscale.datasets

    ds, info = tfscale.datasets.load(
        config.dataset,
        "train",
        global_batch,
        strategy,
        seed=config.seed,
        data_dir=config.data_dir,
        shuffle_buffer=config.shuffle_buffer,
        sharding=config.sharding,
        with_info=True,
    )
    if config.steps_per_epoch:
        ds = ds.repeat()  # Keras keeps one iterator across epochs when steps are given.
    return (ds, info, *_eval_dataset(config, strategy, global_batch))


def _optimizer(config, learning_rate):
    import keras

    if config.optimizer not in tfscale_flags.OPTIMIZERS:
        raise TrainError(
            f"Invalid value for `optimizer`. Received: optimizer={config.optimizer!r}. "
            f"Expected one of {sorted(tfscale_flags.OPTIMIZERS)}."
        )
    return getattr(keras.optimizers, tfscale_flags.OPTIMIZERS[config.optimizer])(learning_rate)


def _callbacks(config, replicas, info, steps_per_epoch, is_chief, *, elastic=None):
    import keras

    from tfscale.callbacks.lr_warmup import LearningRateWarmup
    from tfscale.callbacks.step_timer import StepTimer

    timer = StepTimer(info.global_batch_size, replicas, config.steps_per_execution)
    callbacks = [timer]
    scale = replicas if config.lr_scaling == "linear" else 1
    if config.lr_warmup_epochs or scale != 1:
        # Goyal et al. ramp from the base rate to rate x replicas; unscaled, ramp from zero.
        initial = config.learning_rate if scale != 1 else 0.0
        callbacks.insert(
            0,
            LearningRateWarmup(
                config.learning_rate, config.lr_warmup_epochs, steps_per_epoch, scale, initial
            ),
        )
    if config.backup_dir:
        callbacks.append(_backup_callback(config, info.global_batch_size, elastic))
    if config.fail_at_step:
        callbacks.append(_fail_at_callback(config.fail_at_step))
    if config.profile_steps:
        callbacks.append(_profiler_callback(config))
    if is_chief and config.model_dir:
        if importlib.util.find_spec("tensorboard") is None:
            _log.warning("no TensorBoard logs: the `tensorboard` package is not installed")
        else:
            callbacks.append(keras.callbacks.TensorBoard(os.path.join(config.model_dir, "logs")))
    return callbacks, timer


def _profiler_callback(config):
    from tfscale.callbacks import CommunicationProfiler

    log_dir = os.path.join(config.model_dir, "profile") if config.model_dir else "tfscale_profile"
    return CommunicationProfiler(log_dir, tfscale_flags.parse_profile_steps(config.profile_steps))


def _backup_callback(config, global_batch, elastic):
    from tfscale.callbacks import BackupAndRestore, ElasticBackupAndRestore

    if elastic is not None:  # backups made at another size resume here
        return ElasticBackupAndRestore(
            config.backup_dir,
            save_freq=config.backup_freq,
            global_batch_size=global_batch,
            async_save=config.backup_async,
        )
    return BackupAndRestore(config.backup_dir, save_freq=config.backup_freq, async_save=config.backup_async)


def _elastic(config, global_batch, replicas):
    """Under `tfscale-launch --num_workers MIN:MAX`: the config, global batch and rule for this size."""
    try:
        elastic = _task_protocol.elastic_batch(
            global_batch,
            config.learning_rate,
            num_replicas=replicas,
            num_workers=config.cluster.num_workers if config.cluster is not None else 1,
            per_replica_batch_size=config.per_replica_batch_size,
        )
    except errors.LaunchError as e:
        raise TrainError(str(e)) from None
    if elastic is None:
        return config, global_batch, None
    _log.info("%s", elastic.describe())
    config = dataclasses.replace(config, learning_rate=elastic.learning_rate)
    return config, elastic.global_batch_size, elastic


def _fail_at_callback(step):
    from tfscale.callbacks import FailAt

    # SIGKILL: no cleanup at all, the harshest fault a restart has to survive. Under
    # tfscale-launch only the first attempt fails, so that the restarted job replays the
    # step (from a backup before it) without failing again.
    first_attempt = 0 if _task_protocol.RESTART_COUNT_VAR in os.environ else None
    return FailAt(step, mode="sigkill", restart_count=first_attempt)


def _data_parallel(strategy):
    """(the `tf.distribute` strategy that feeds the data, data-parallel replicas) of `strategy`.

    A pipeline or model split (a strategy with `split`) is fed whole global batches by the
    default strategy; its own `data_parallel` copies each take their slice of every batch.
    """
    import tensorflow as tf

    if hasattr(strategy, "split"):
        return tf.distribute.get_strategy(), strategy.data_parallel
    return strategy, strategy.num_replicas_in_sync


def _build_model(config, strategy, info, learning_rate):
    """The registry model built in the strategy's scope (split by a model-parallel one), compiled."""
    import keras

    from tfscale import models

    features = info.element_spec[0]
    data_strategy, _ = _data_parallel(strategy)
    with data_strategy.scope():
        model = models.build(config.model, features.shape[1:], info.num_classes)
        if hasattr(strategy, "split"):
            model = strategy.split(model)
        model.compile(
            optimizer=_optimizer(config, learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            jit_compile=config.jit_compile,
            steps_per_execution=config.steps_per_execution,
        )
    return model


def _check_steps_per_execution(config, strategy):
    """Raises `TrainError` for steps_per_execution > 1 under a multi-replica MirroredStrategy."""
    # One line instead of a crash in `fit`: Keras 3 (to at least 3.15.1) cannot run several steps
    # per execution there ("You must feed a value for placeholder tensor ... while/cond";
    # keras-team/keras#19246, open). Seen here with TF 2.21, stock Keras and with tfscale.compat.
    import tensorflow as tf

    replicas = strategy.num_replicas_in_sync
    if (
        config.steps_per_execution > 1
        and replicas > 1
        and isinstance(strategy, tf.distribute.MirroredStrategy)
    ):
        raise TrainError(
            f"`steps_per_execution={config.steps_per_execution}` cannot run under strategy "
            f"'mirrored' with {replicas} replicas (Keras 3 fails in fit: keras-team/keras#19246). "
            "Expected steps_per_execution=1 there, or one replica."
        )


def _plan_report(model, info, global_batch):
    """The pipelined model's planning report for one global batch, as text.

    Zeros of the batch's shape: the bytes depend on shapes only, and iterating the
    dataset here would advance its reshuffling (another order of examples than without).
    """
    import tensorflow as tf

    x, y = (tf.zeros([global_batch, *s.shape[1:]], s.dtype) for s in info.element_spec[:2])
    return model.plan_report(x, y).table()


def _save(model, strategy, config, result_fields):
    """Writes `model.keras` and `summary.json` under `model_dir`, each atomically (chief only).

    A pipelined or split model is saved merged: the user's architecture, loadable anywhere.
    """
    if hasattr(strategy, "merge"):
        model = strategy.merge(model)
    os.makedirs(config.model_dir, exist_ok=True)
    path = os.path.join(config.model_dir, "model.keras")
    model.save(path + ".tmp.keras")
    os.replace(path + ".tmp.keras", path)
    summary = os.path.join(config.model_dir, "summary.json")
    with open(summary + ".tmp", "w") as f:
        json.dump({**result_fields, "model_path": path}, f, indent=1, sort_keys=True)
    os.replace(summary + ".tmp", summary)
    return path


def _floats(logs):
    return {k: [float(v) for v in vs] if isinstance(vs, list) else float(vs) for k, vs in logs.items()}


def _connect(cluster, options):
    """A pipeline or model split across the tasks of `cluster`: connects, or serves.

    The chief (worker 0 without one) becomes the client that trains on every task's devices
    (each task's `--cpu_replicas` logical CPUs, else its GPUs); every other task serves its
    devices until the client has gone. Returns True on the client. `options` loses
    `cpu_replicas` (each task split its own CPU) and `cluster_timeout` (spent here).
    """
    import tfscale.strategies

    cpus = options.pop("cpu_replicas", None)
    if cpus:
        tfscale.strategies.split_cpu(cpus)
    timeout = options.pop("cluster_timeout", None)
    kwargs = {} if timeout is None else {"cluster_timeout": timeout}
    client = tfscale.strategies.connect_cluster(cluster, **kwargs)
    if not client:
        _log.info("train: %s served its devices to the client until it finished", cluster.task_label)
    return client


def train(config):
    """Trains `config.model` on `config.dataset` under the configured strategy.

    Args:
        config: a `TrainConfig`.

    Returns:
        A `TrainResult` (history, evaluation, throughput, where the model was saved); None on
        a task that only served its devices to another task's pipeline or model split.

    Raises:
        tfscale.Error: options that cannot be honoured (`TrainError`, `StrategyError`,
            `DatasetError`, `ModelError`, `ClusterSpecError`, `BackupError`, ...), each
            with a one-line message.
    """
    import keras

    import tfscale.strategies

    cluster = _cluster(config)
    options = dict(config.strategy_options)
    if config.strategy in tfscale_flags.MODEL_PARALLEL and cluster.task_count > 1:
        if not _connect(cluster, options):
            return None  # This task served its devices to the client, which has finished.
    strategy = tfscale.strategies.get(config.strategy, cluster=cluster, **options)
    name = f"{config.strategy} ({type(strategy).__name__})"
    data_strategy, replicas = _data_parallel(strategy)
    _check_steps_per_execution(config, data_strategy)
    is_chief = cluster.is_writer  # Writes the logs and the model; prints Keras's progress.
    keras.mixed_precision.set_global_policy(config.mixed_precision)
    # tf.data combines an op's seed with the global seed: fix both before the datasets exist.
    keras.utils.set_random_seed(config.seed)
    global_batch = _global_batch(config, replicas)
    config, global_batch, elastic = _elastic(config, global_batch, replicas)
    ds, info, eval_ds, eval_split = _datasets(config, data_strategy, global_batch)
    steps = config.steps_per_epoch or info.steps_per_epoch
    scale = replicas if config.lr_scaling == "linear" else 1
    # Seeded again: preparing a TFDS dataset on first use draws from the global RNGs, and
    # the initial weights must not depend on whether that happened in this run.
    keras.utils.set_random_seed(config.seed)
    model = _build_model(config, strategy, info, config.learning_rate * scale)
    callbacks, timer = _callbacks(config, replicas, info, steps, is_chief, elastic=elastic)
    if config.plan_report:
        _log.info("%s", _plan_report(model, info, global_batch))
    _log.info(
        "train: strategy=%s replicas=%d workers=%d global_batch=%d steps/epoch=%d",
        name,
        replicas,
        info.num_workers,
        global_batch,
        steps,
    )
    start = time.perf_counter()
    history = model.fit(
        ds,
        epochs=config.epochs,
        steps_per_epoch=config.steps_per_epoch,
        callbacks=callbacks,
        shuffle=False,  # load() already shuffles, by seed; Keras would only warn.
        verbose=config.verbose if is_chief else 0,
    )
    seconds = time.perf_counter() - start
    evaluation = {}
    if eval_ds is not None:
        logs = model.evaluate(eval_ds, return_dict=True, verbose=0)
        evaluation = {f"{eval_split}_{k}": v for k, v in logs.items()}
    fields = dict(
        strategy=name,
        num_replicas=replicas,
        num_workers=info.num_workers,
        task=cluster.task_label,
        is_chief=is_chief,
        global_batch_size=global_batch,
        sharding=info.sharding,
        epochs=config.epochs,
        steps_per_epoch=steps,
        seconds=seconds,
        examples_per_sec=timer.throughput,
        history=_floats(history.history),
        evaluation=_floats(evaluation),
    )
    restored = [c.restored_from for c in callbacks if getattr(c, "restored_from", None)]
    fields["resumed_at_step"] = restored[0]["global_step"] if restored else 0
    model_path = _save(model, strategy, config, fields) if is_chief and config.model_dir else None
    return TrainResult(**fields, model_path=model_path)


def summary_lines(result):
    """The short human summary `run` prints."""
    h, e = result.history, result.evaluation
    rate = f"{result.examples_per_sec:.0f} examples/s" if result.examples_per_sec else "examples/s n/a"
    per_replica = (
        f" ({result.examples_per_sec / result.num_replicas:.0f} per replica)"
        if result.examples_per_sec
        else ""
    )
    evaluated = " ".join(f"{k}={v:.4f}" for k, v in sorted(e.items()))
    total = result.epochs * result.steps_per_epoch
    trained = f"trained {result.epochs} epochs x {result.steps_per_epoch} steps"
    if result.resumed_at_step:  # Only the steps after the backup ran in this process.
        trained = (
            f"resumed at step {result.resumed_at_step} of {total}: trained the remaining "
            f"{total - result.resumed_at_step} steps"
        )
    return [
        f"strategy: {result.strategy}, replicas: {result.num_replicas}, workers: {result.num_workers}, "
        f"task: {result.task}, global batch: {result.global_batch_size}, sharding: {result.sharding}",
        f"{trained} in {result.seconds:.1f} s, {rate}{per_replica}",
        f"final train loss={h['loss'][-1]:.4f} accuracy={h['accuracy'][-1]:.4f}; {evaluated}",
    ]


def main(argv, fv):
    """Parses `argv` into `fv` (with tfscale's flags defined), trains, prints the summary."""
    fv(argv)
    result = train(config_from_flags(fv))
    if result is None:  # A serving task: the client prints the summary and the result.
        return None
    for line in summary_lines(result):
        print(line)
    print(RESULT_PREFIX + result.to_json(), flush=True)
    return result


def parse(argv, fv):
    """Parses `argv` into `fv`; returns `argv`, or the exit status (help, bad flags)."""
    if any(a in ("--help", "-h", "--helpshort", "--helpfull") for a in argv[1:]):
        print(fv.get_help())
        return 0
    try:
        tfscale_flags.check_flagfiles(argv)
        rest = fv(argv)
        if rest[1:]:  # A stray word (a typo'd flag without dashes) must not be ignored.
            raise flags.Error(f"Unexpected argument {rest[1]!r}. Expected only --flags.")
    except flags.Error as e:
        text = str(e).strip()
        if text.startswith("flags ") and ": --" in text:
            text = "--" + text.split(": --", 1)[1]  # Multi-flag validators: our message names the flags.
        return errors.report("tfscale-train", text)
    return argv


def run(argv=None):
    """Console script `tfscale-train`: a `tfscale.Error` is one line on stderr and its exit status.

    Bad input (a flag, a TF_CONFIG, an option) exits 2; a run that failed exits 1.
    """
    argv = list(sys.argv if argv is None else argv)
    prog = "tfscale-train"
    fv = flags.FlagValues()
    tfscale_flags.define_all(fv)
    parsed = parse(argv, fv)
    if isinstance(parsed, int):
        return parsed
    # TensorFlow's C++ INFO/WARNING lines would bury the one-line errors and the summary.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    _quiet.import_tensorflow()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    _log.addHandler(handler)
    _log.propagate = False  # absl's root handler would print every line a second time on stderr.
    _log.setLevel(logging.INFO)
    try:
        main(argv, fv)
    except Error as e:  # Every tfscale error, and nothing else: a bug still shows its traceback.
        return errors.report(prog, e)
    return 0


if __name__ == "__main__":
    sys.exit(run())
