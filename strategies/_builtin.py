"""`get(name, **options)`: the real tf.distribute strategies, configured well.

The names, each strategy's options (a frozen dataclass with their types and defaults) and
their closed sets of values are `tfscale._strategy_spec`'s; `get` checks the options
against it, builds the dataclass, and hands it to the strategy's builder here.
"""

import dataclasses
import inspect
import logging
import os
import socket
import urllib.parse

import tensorflow as tf

from tfscale import _strategy_spec as _spec
from tfscale import compat
from tfscale._auto import choose as _choose_auto
from tfscale._auto import tpu_named as _tpu_named
from tfscale.cluster import ClusterSpec
from tfscale.compat import collective_keys, keras_batch_norm, keras_multi_worker, keras_random_layers
from tfscale.strategies import _communication, _zero
from tfscale.strategies._devices import (
    cpu_device_names,
    device_type,
    local_device_names,
    parse_device,
    split_cpu,
)
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check, reject_unknown
from tfscale.strategies._peers import build_within, check_cluster_timeout
from tfscale.strategies._replicas import check_data_parallel

__all__ = ["NAMES", "get"]

_log = logging.getLogger("tfscale")

# TensorFlow's class for each of `_spec.CROSS_DEVICE_OPS`.
_CROSS_DEVICE_OPS = {
    "nccl": tf.distribute.NcclAllReduce,
    "hierarchical_copy": tf.distribute.HierarchicalCopyAllReduce,
    "reduction_to_one_device": tf.distribute.ReductionToOneDevice,
}
_TPU_PROBE_SECONDS = 5.0


def _num_gpus():
    return len(tf.config.list_physical_devices("GPU"))


def _default(options):
    del options  # DefaultOptions: none
    return tf.distribute.get_strategy()


def _local_devices(devices, argument):
    """Canonical names of `devices`, each a device of this machine, or `StrategyError` naming it."""
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices:
        raise StrategyError(
            f"Invalid value for argument `{argument}`. Received: {argument}={devices!r}. Expected a "
            "non-empty list of device names."
        )
    names = [parse_device(d, argument) for d in devices]
    for name, given in zip(names, devices):
        known = local_device_names(device_type(name))
        if name not in known:  # TensorFlow would place the work on CPU:0 without a word
            raise StrategyError(
                f"Invalid value for argument `{argument}`. Received: {given!r}, which does not exist "
                f"here. Expected names from {known or cpu_device_names(1)}."
            )
    return names


def _one_device(options):
    device = options.device
    if device is None:
        device = "/gpu:0" if _num_gpus() else "/cpu:0"
    (name,) = _local_devices([device], "device")
    return tf.distribute.OneDeviceStrategy(name)


def _mirrored(options):
    devices, num_gpus, cpu_replicas = options.devices, options.num_gpus, options.cpu_replicas
    cross_device_ops = options.cross_device_ops
    zero_stage = _zero.check_stage(options.zero_stage)
    replica_statistics = check("replica_statistics", options.replica_statistics)
    replica_random = check("replica_random", options.replica_random)
    communication = _communication.Communication(
        gradient_compression=options.gradient_compression,
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=options.timeout_seconds,
    )
    exclusive = (("devices", devices), ("num_gpus", num_gpus), ("cpu_replicas", cpu_replicas))
    given = [k for k, v in exclusive if v is not None]
    if len(given) > 1:
        raise StrategyError(
            f"Arguments {', '.join(f'`{g}`' for g in given)} of strategy 'mirrored' exclude "
            "each other. Expected at most one of `devices`, `num_gpus`, `cpu_replicas`."
        )
    if num_gpus is not None:
        available = _num_gpus()
        if check("num_gpus", num_gpus) > available:
            raise StrategyError(
                f"Invalid value for argument `num_gpus`. Received: num_gpus={num_gpus!r}. "
                + (
                    f"Expected an integer from 1 to {available}, the GPUs visible here."
                    if available
                    else "Expected no `num_gpus`: no GPU is visible here (use `cpu_replicas` on a CPU)."
                )
            )
        devices = [f"/gpu:{i}" for i in range(num_gpus)]
    if cpu_replicas is not None:
        devices = split_cpu(cpu_replicas)
    elif devices is not None and num_gpus is None:
        devices = _local_devices(devices, "devices")
    ops = None
    if cross_device_ops is not None:
        check("cross_device_ops", cross_device_ops)
        if cross_device_ops == "nccl" and not _num_gpus():
            raise StrategyError(
                "`cross_device_ops='nccl'` needs GPUs and none is visible here. "
                "Expected 'hierarchical_copy' or 'reduction_to_one_device' on CPU."
            )
        ops = _CROSS_DEVICE_OPS[cross_device_ops]()
    # The one set of Keras fixes for Mirrored/MWMS, also `tfscale-launch --keras_compat`'s.
    compat.apply_strategy_fixes()
    # Fresh collective keys on both sides: strategies built before or after this one
    # (by tfscale or by hand) must not share group keys with it.
    collective_keys.reserve_key_range()
    strategy = tf.distribute.MirroredStrategy(devices=devices, cross_device_ops=ops)
    collective_keys.reserve_key_range()
    _communication.configure(strategy, **dataclasses.asdict(communication))
    _zero.configure(strategy, zero_stage)
    # BatchNormalization: the global batch's statistics unless asked (tfscale/compat/keras_batch_norm.py).
    keras_batch_norm.keep_replica_statistics(strategy, replica_statistics)
    # Dropout: one device's masks unless asked (tfscale/compat/keras_random_layers.py).
    keras_random_layers.keep_replica_random(strategy, replica_random)
    return strategy


def _multi_worker(options, cluster):
    communication, timeout_seconds = options.communication, options.timeout_seconds
    cluster_resolver, cpu_replicas = options.cluster_resolver, options.cpu_replicas
    check("communication", communication)
    replica_statistics = check("replica_statistics", options.replica_statistics)
    replica_random = check("replica_random", options.replica_random)
    cluster_timeout = check_cluster_timeout(options.cluster_timeout)
    if timeout_seconds is not None:
        check("timeout_seconds", timeout_seconds)
    if cpu_replicas is not None:
        split_cpu(cpu_replicas)
    collectives = tf.distribute.experimental.CommunicationOptions(
        implementation=_communication.IMPLEMENTATIONS[communication], timeout_seconds=timeout_seconds
    )
    if cluster_resolver is None and not cluster.is_local:
        cluster_resolver = cluster.to_resolver()  # Else TensorFlow's default: one local worker.
    gradients = _communication.Communication(
        gradient_compression=options.gradient_compression,
        bytes_per_pack=options.bytes_per_pack,
        timeout_seconds=timeout_seconds,
        implementation=communication,
    )
    compat.apply_strategy_fixes()  # The same set as `_mirrored` and `tfscale-launch --keras_compat`.
    strategy = build_within(
        cluster,
        cluster_timeout,
        lambda: keras_multi_worker.make_multi_worker_strategy(
            cluster_resolver=cluster_resolver, communication_options=collectives, cpu_replicas=cpu_replicas
        ),
    )
    _communication.configure(strategy, **dataclasses.asdict(gradients))
    keras_batch_norm.keep_replica_statistics(strategy, replica_statistics)
    # Dropout: one device's masks unless asked (tfscale/compat/keras_random_layers.py).
    keras_random_layers.keep_replica_random(strategy, replica_random)
    return strategy


def _probe(address):
    """Fails fast on an unreachable grpc:// address instead of hanging in connect."""
    parsed = urllib.parse.urlparse(address)
    if parsed.scheme != "grpc":
        return
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=_TPU_PROBE_SECONDS).close()
    except (OSError, ValueError, TypeError) as e:
        raise StrategyError(f"No TPU reachable at `tpu={address!r}`: {e}.") from None


def _tpu(options):
    tpu = options.tpu
    if tpu is not None and not isinstance(tpu, str):
        raise StrategyError(
            f"Invalid value for argument `tpu`. Received: tpu={tpu!r}. Expected a TPU name or a "
            "grpc:// address."
        )
    if tpu is not None:
        _probe(tpu)
    try:
        resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=tpu)
        if tpu not in (None, "", "local"):
            tf.config.experimental_connect_to_cluster(resolver)
        tf.tpu.experimental.initialize_tpu_system(resolver)
    except (ValueError, RuntimeError, OSError, tf.errors.OpError) as e:
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise StrategyError(f"No TPU reachable at `tpu={tpu!r}`: {first_line}") from None
    return tf.distribute.TPUStrategy(resolver)


def _auto(options, cluster):
    cpu_replicas, tpu = options.cpu_replicas, options.tpu
    cluster_timeout = check_cluster_timeout(options.cluster_timeout)
    gpus = _num_gpus()
    name, reason = _choose_auto(
        tpu=_tpu_named(tpu, os.environ) or bool(tf.config.list_physical_devices("TPU")),
        num_workers=cluster.num_workers,
        gpus=gpus,
        cpu_replicas=cpu_replicas,
    )
    _log.info("strategy auto -> %s (%s)", name, reason)
    if name == "tpu":
        return _tpu(_spec.TPUOptions(tpu=tpu))
    if name == "multi_worker":
        return _multi_worker(
            _spec.MultiWorkerOptions(
                communication=options.communication,
                timeout_seconds=options.timeout_seconds,
                cpu_replicas=cpu_replicas,
                cluster_timeout=cluster_timeout,
            ),
            cluster,
        )
    if name == "mirrored":
        return _mirrored(_spec.MirroredOptions(cpu_replicas=cpu_replicas or None))
    if cpu_replicas:
        split_cpu(cpu_replicas)
    return _one_device(_spec.OneDeviceOptions(device="/gpu:0" if gpus else cpu_device_names(1)[0]))


def _class_options(name, options):
    """The keyword arguments of strategy `name`'s class, with get's `cpu_replicas=N` made `devices`.

    `cpu_replicas=N` means for the model-parallel strategies what it means for mirrored: the
    host CPU is split into N logical devices, and the strategy runs on the first D x K of them
    (K the devices of one copy, `_spec.copy_devices`), not on GPUs.
    """
    kwargs = {field.name: getattr(options, field.name) for field in dataclasses.fields(options)}
    cpu_replicas = kwargs.pop("cpu_replicas")
    if cpu_replicas is None:
        return kwargs
    if options.devices is not None:
        raise StrategyError(
            f"Arguments `devices` and `cpu_replicas` of strategy {name!r} exclude each other. "
            "Expected at most one of them."
        )
    names = split_cpu(cpu_replicas)
    data_parallel = check("data_parallel", options.data_parallel)
    count_argument, per_copy = _spec.copy_devices(name, options)
    if per_copy is None:
        per_copy = len(names) // data_parallel or 1
    check(count_argument, per_copy)
    check_data_parallel(data_parallel, per_copy, len(names), count_argument=count_argument)
    kwargs.pop("num_devices", None)  # model_split: the devices given now say K
    return {**kwargs, "devices": names[: data_parallel * per_copy]}


def _pipeline(options):
    from tfscale.strategies.pipeline import PipelineStrategy

    return PipelineStrategy(**_class_options("pipeline", options))


def _model_split(options):
    from tfscale.strategies.model_split import ModelSplitStrategy

    return ModelSplitStrategy(**_class_options("model_split", options))


# The builder of each name of `_spec.NAMES`: `builder(options)`, or `builder(options, cluster)`
# for the strategies that run in a cluster; `options` is the name's `_spec.OPTIONS` dataclass.
_BUILDERS = {
    "auto": _auto,
    "default": _default,
    "one_device": _one_device,
    "mirrored": _mirrored,
    "multi_worker": _multi_worker,
    "tpu": _tpu,
    "pipeline": _pipeline,
    "model_split": _model_split,
}
NAMES = _spec.NAMES


def _cluster(cluster):
    if cluster is None:
        return ClusterSpec.from_env(allow_unset=True)
    if not isinstance(cluster, ClusterSpec):
        raise StrategyError(
            f"Invalid value for argument `cluster`. Received: cluster={cluster!r}. Expected a "
            "tfscale.cluster.ClusterSpec or None (read TF_CONFIG)."
        )
    return cluster


def get(name="auto", *, cluster=None, **options):
    """Returns a configured distribution strategy.

    Built-in names return the real `tf.distribute` object; `"pipeline"` and
    `"model_split"` return tfscale's own strategies.

    Args:
        name: one of `NAMES`: "auto", "default", "one_device", "mirrored",
            "multi_worker", "tpu", "pipeline", "model_split".
        cluster: the `tfscale.cluster.ClusterSpec` of this process, which "auto" and
            "multi_worker" run in. Default: `ClusterSpec.from_env(allow_unset=True)`,
            the `TF_CONFIG` of the environment, else one local process.
        **options: options of that strategy, the fields of its frozen dataclass
            `tfscale._strategy_spec.OPTIONS[name]` (types and defaults there; the
            table in docs/strategies.md), e.g. `cpu_replicas=2` to replicate over 2
            logical CPU devices.

    Returns:
        A `tf.distribute.Strategy` for the built-in names; a
        `tfscale.strategies.PipelineStrategy` or `ModelSplitStrategy` (plain objects
        whose `wrap`/`split` turn a Keras model into a pipelined or split one) for
        "pipeline" and "model_split".

    Raises:
        StrategyError: unknown name, unknown option, or an option value the
            strategy cannot honour here.
        ClusterSpecError: `cluster` is None and `TF_CONFIG` is malformed.

    Example:

    >>> strategy = tfscale.strategies.get("mirrored", cpu_replicas=2)
    >>> strategy.num_replicas_in_sync
    2
    """
    if not isinstance(name, str) or name not in _spec.OPTIONS:
        raise StrategyError(f"Unknown strategy name. Received: name={name!r}. Expected one of {list(NAMES)}.")
    if "zero_stage" in options:
        _zero.check_strategy(name, options["zero_stage"])
    # A StrategyError (not Python's TypeError) for an option the strategy does not take.
    accepted = _spec.option_names(name)
    reject_unknown(name, set(options) - set(accepted), accepted)
    builder = _BUILDERS[name]
    arguments = [_spec.OPTIONS[name](**options)]
    if "cluster" in inspect.signature(builder).parameters:
        arguments.append(_cluster(cluster))
    elif cluster is not None:
        _cluster(cluster)  # Checked for every name, used by the ones that run in a cluster.
    # Custom-gradient graphs freed, input iterators parked, steps_per_execution step by step
    # (tfscale/compat/__init__.py); "mirrored" and "multi_worker" add theirs in the builder.
    compat.apply_every_strategy_fixes()
    return builder(*arguments)
