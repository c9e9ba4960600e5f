"""`load(name, split, global_batch_size, strategy)`: a `tf.data.Dataset` ready for `fit`.

How a dataset is spread over a cluster (`DatasetInfo.sharding`, also logged):

- "none": one worker. Batches hold `global_batch_size` examples and `tf.distribute`
  hands each local replica its slice of every batch.
- "data": every worker reads the same seeded, globally shuffled stream of global batches
  (`AutoShardPolicy.DATA`); `tf.distribute` cuts each global batch into one piece per
  replica of the cluster and each worker keeps only its own pieces. Workers receive
  disjoint examples that together make every global batch, so a step is the same
  computation as on one device. Chosen for data held in memory (reading it all is cheap).
- "files": each worker reads only its own TFDS file shards (`tfds.ReadConfig(input_context=
  ...)`, `AutoShardPolicy.OFF`) and shuffles them locally; no worker reads another's
  bytes. Chosen for data too large to cache, when there are at least as many files as
  workers. Steps see different example mixes than one device does.
"""

import dataclasses
import logging

import tensorflow as tf

from tfscale.cluster import ClusterSpec
from tfscale.datasets import _sources
from tfscale.datasets._errors import DatasetError

__all__ = ["CACHE_LIMIT_BYTES", "FLOAT_LIMIT_BYTES", "SHARDING_POLICIES", "DatasetInfo", "load"]

_log = logging.getLogger("tfscale")

CACHE_LIMIT_BYTES = 32 << 20  # A split this small (on disk) is read into memory at load().
FLOAT_LIMIT_BYTES = 1 << 30  # In memory, uint8 images become float32 once, if they stay under this.
SHARDING_POLICIES = ("auto", "data", "files")


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What `load` built (returned with `with_info=True`)."""

    name: str
    split: str
    num_examples: int
    num_classes: int
    element_spec: object
    global_batch_size: int
    per_replica_batch_size: int
    steps_per_epoch: int
    num_workers: int
    worker_index: int
    sharding: str
    cached: bool


def _worker_context(strategy):
    """(num_workers, this worker's index, replicas in sync) for any strategy.

    The strategy's own cluster, not the environment's: a strategy that runs outside the
    collectives (an evaluator's, a mirrored one) reads the whole dataset.
    """
    cluster = ClusterSpec.from_strategy(strategy)
    if not cluster.is_multi_worker:
        return 1, 0, strategy.num_replicas_in_sync
    return cluster.num_workers, cluster.worker_index, strategy.num_replicas_in_sync


def _check_batch(global_batch_size, replicas, num_examples, drop_remainder):
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise DatasetError(
            f"Invalid value for argument `global_batch_size`. Received: global_batch_size="
            f"{global_batch_size!r}. Expected a positive integer."
        )
    if global_batch_size % replicas:
        raise DatasetError(
            f"`global_batch_size={global_batch_size}` is not divisible by the {replicas} replicas in "
            f"sync. Expected a multiple of {replicas}."
        )
    if drop_remainder and global_batch_size > num_examples:
        raise DatasetError(
            f"`global_batch_size={global_batch_size}` is larger than the {num_examples} examples of "
            "the split, so no full batch exists. Expected at most that many."
        )


def _choose_sharding(policy, source, num_workers, in_memory):
    if policy not in SHARDING_POLICIES:
        raise DatasetError(
            f"Invalid value for argument `sharding`. Received: sharding={policy!r}. "
            f"Expected one of {list(SHARDING_POLICIES)}."
        )
    if num_workers == 1:
        return "none", "one worker"
    if policy == "files" or (policy == "auto" and not in_memory and source.num_files >= num_workers):
        if source.num_files < num_workers:
            raise DatasetError(
                f"`sharding='files'` needs at least one file per worker, but {source.name}/"
                f"{source.split} has {source.num_files} file(s) for {num_workers} workers. "
                "Expected sharding='data' (or re-prepare it with more shards)."
            )
        return "files", f"{source.num_files} file shards over {num_workers} workers"
    reason = "in memory" if in_memory else f"only {source.num_files} file(s)"
    return "data", f"{reason}: every worker reads all, keeps its slice of each global batch"


def _to_float(x):
    return tf.cast(x, tf.float32) / 255.0 if x.dtype == tf.uint8 else x


def _features(source, as_supervised):
    """Selects (and converts) the features of a batch of example dicts."""
    key = source.feature_key
    if as_supervised:
        return lambda ex: (_to_float(ex[key]), ex["label"])
    return lambda ex: {**ex, key: _to_float(ex[key])}


def _materialize(ds, source, as_supervised):
    """Reads a small split once, now, into memory, in the form `fit` takes it.

    Not `Dataset.cache()`, which the first iterator fills lazily while Keras abandons a
    half-read iterator (it takes one batch to build the model): with TF 2.21 / Keras 3.15.1,
    `evaluate` on a lazily cached split was seen here to get fewer batches than the split
    holds, in some runs, so test metrics changed from run to run. Reading it up front is
    deterministic, makes the "data" sharding policy cheap, and lets each epoch be just
    shuffle + batch of ready tensors. uint8 images become float32 here (4x the memory)
    unless that would pass `FLOAT_LIMIT_BYTES`; then they are converted per batch.

    Returns:
        The dataset, and whether batches still need `_features`.
    """
    examples = ds.batch(source.num_examples).get_single_element()
    x = examples[source.feature_key]
    if x.dtype == tf.uint8 and x.shape.num_elements() * 4 > FLOAT_LIMIT_BYTES:
        return tf.data.Dataset.from_tensor_slices(examples), True
    x = _to_float(x)
    if as_supervised:
        return tf.data.Dataset.from_tensor_slices((x, examples["label"])), False
    return tf.data.Dataset.from_tensor_slices({**examples, source.feature_key: x}), False


def load(
    name,
    split="train",
    global_batch_size=64,
    strategy=None,
    *,
    shuffle=None,
    seed=0,
    data_dir=None,
    shuffle_buffer=None,
    cache=None,
    drop_remainder=None,
    as_supervised=True,
    sharding="auto",
    with_info=False,
):
    """Returns a batched `tf.data.Dataset` ready for `model.fit` under `strategy`.

    Pass it straight to `fit`/`evaluate` (Keras distributes it with
    `strategy.experimental_distribute_dataset`): each element is one GLOBAL batch,
    `global_batch_size / num_replicas_in_sync` examples per replica. The dataset is one
    epoch long; iterating it again reshuffles it (deterministically, by `seed`).

    Args:
        name: "digits" (bundled, no network), "tfds:NAME[/CONFIG][:VERSION]" (a TFDS
            dataset already prepared in `data_dir`; never downloaded) or "synthetic:..."
            (see `tfscale.datasets.synthetic`).
        split: a split of the dataset, e.g. "train", "test".
        global_batch_size: examples per step over all replicas of all workers.
        strategy: the `tf.distribute.Strategy` the dataset is for (default: the current one).
        shuffle: shuffle examples (and files); default: True for splits named "train*".
        seed: shuffling seed, the same in every worker. As for any tf.data shuffle, the
            order also depends on TensorFlow's global seed (`tf.random.set_seed`).
        data_dir: folder of prepared TFDS datasets (must exist); the bundled dataset is
            prepared there on first use. Default: TFDS's for "tfds:", `$TFSCALE_DATA_DIR`
            or ~/.cache/tfscale/tensorflow_datasets for "digits".
        shuffle_buffer: shuffle buffer size; default: the whole split when cached, else 10000.
        cache: read the split into memory (decoded) when `load` is called; default: when
            it is under 32 MiB on disk (synthetic data is in memory already and is not cached again).
        drop_remainder: drop a last partial batch; default: `shuffle` (training).
        as_supervised: `(features, label)` pairs for `fit`; False gives feature dicts
            (with `id` for the bundled and synthetic datasets).
        sharding: "auto", "data" or "files" (see the module docstring).
        with_info: also return a `DatasetInfo`.

    Returns:
        A `tf.data.Dataset`, or `(dataset, DatasetInfo)` with `with_info`.

    Raises:
        DatasetError: unknown name or split, missing or unprepared data, a batch size that is
            not a positive multiple of the replicas in sync, an impossible sharding.
    """
    strategy = strategy or tf.distribute.get_strategy()
    num_workers, worker_index, replicas = _worker_context(strategy)
    source = _sources.resolve(name, split, data_dir)
    shuffle = split.startswith("train") if shuffle is None else bool(shuffle)
    drop_remainder = shuffle if drop_remainder is None else bool(drop_remainder)
    _check_batch(global_batch_size, replicas, source.num_examples, drop_remainder)
    if cache is None:
        cache = not source.in_memory and source.size_bytes <= CACHE_LIMIT_BYTES
    policy, reason = _choose_sharding(sharding, source, num_workers, bool(cache) or source.in_memory)
    # Worth a line when there are workers to shard over; with one it is always "none".
    level = logging.INFO if num_workers > 1 else logging.DEBUG
    _log.log(level, "dataset %s/%s: sharding=%s (%s)", name, split, policy, reason)

    context = None
    if policy == "files":
        context = tf.distribute.InputContext(num_workers, worker_index, replicas)
    ds = source.read(shuffle_files=shuffle and policy == "files", seed=seed, input_context=context)
    convert = True
    if cache or source.in_memory:
        ds, convert = _materialize(ds, source, as_supervised)
    if shuffle:
        buffer = shuffle_buffer or (source.num_examples if cache or source.in_memory else 10_000)
        ds = ds.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(global_batch_size, drop_remainder=drop_remainder)
    if convert:
        # Per batch, not per example: one vectorized op instead of thousands of small ones.
        ds = ds.map(_features(source, as_supervised), num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    ds = ds.prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    options.deterministic = True
    options.experimental_distribute.auto_shard_policy = (
        tf.data.experimental.AutoShardPolicy.OFF
        if policy == "files"
        else tf.data.experimental.AutoShardPolicy.DATA
    )
    ds = ds.with_options(options)
    if not with_info:
        return ds
    examples = source.num_examples // num_workers if policy == "files" else source.num_examples
    steps = examples // global_batch_size * (num_workers if policy == "files" else 1)
    if not drop_remainder and source.num_examples % global_batch_size:
        steps += 1
    info = DatasetInfo(
        name=name,
        split=split,
        num_examples=source.num_examples,
        num_classes=source.num_classes,
        element_spec=ds.element_spec,
        global_batch_size=global_batch_size,
        per_replica_batch_size=global_batch_size // replicas,
        steps_per_epoch=steps,
        num_workers=num_workers,
        worker_index=worker_index,
        sharding=policy,
        cached=bool(cache),
    )
    return ds, info
