"""tfscale.strategies.get: each built-in strategy's options really take effect.

Checked by what TensorFlow does, not by the options it was handed: where variables live,
which all-reduce ops a replica step compiles to, which object `default` is.
"""

import collections

import pytest
import tensorflow as tf

from tfscale.strategies import StrategyError, get

HAS_GPU = bool(tf.config.list_physical_devices("GPU"))


@pytest.mark.parametrize("device", ["/cpu:1", "/cpu:3", "/job:localhost/replica:0/task:0/device:CPU:2"])
def test_one_device_places_variables_on_the_named_device(device):
    strategy = get("one_device", device=device)
    with strategy.scope():
        variable = tf.Variable(1.0)
    want = tf.DeviceSpec.from_string(device)
    got = tf.DeviceSpec.from_string(variable.device)
    assert (got.device_type, got.device_index) == (want.device_type, want.device_index)


def _all_reduce_ops(strategy):
    """Op types (and counts) of one compiled replica step summing `replica_id + 1`, and its results."""

    @tf.function
    def step():
        def replica_fn():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("sum", tf.cast(context.replica_id_in_sync_group, tf.float32) + 1.0)

        return strategy.run(replica_fn)

    results = [float(r) for r in strategy.experimental_local_results(step())]
    graph = step.get_concrete_function().graph
    return collections.Counter(op.type for op in graph.get_operations()), results


# Each implementation leaves its own trace in the graph of a 4-replica all-reduce: the default
# (TF 2.21 on CPU) one collective op per replica, `reduction_to_one_device` a single AddN on one
# device, `hierarchical_copy` a tree of AddNs over split chunks.
@pytest.mark.parametrize(
    ("cross_device_ops", "collectives", "add_ns"),
    [(None, 4, 0), ("reduction_to_one_device", 0, 1), ("hierarchical_copy", 0, 3)],
)
def test_mirrored_cross_device_ops_is_the_all_reduce_that_runs(cross_device_ops, collectives, add_ns):
    options = {} if cross_device_ops is None else {"cross_device_ops": cross_device_ops}
    strategy = get("mirrored", cpu_replicas=4, **options)
    ops, results = _all_reduce_ops(strategy)
    assert results == [1.0 + 2 + 3 + 4] * 4
    assert (ops["CollectiveReduceV2"], ops["AddN"]) == (collectives, add_ns), dict(ops)


@pytest.mark.skipif(not HAS_GPU, reason="NCCL needs a GPU; on CPU tests/test_strategies.py checks the error")
def test_mirrored_nccl_cross_device_ops_on_gpus():
    strategy = get("mirrored", num_gpus=len(tf.config.list_physical_devices("GPU")), cross_device_ops="nccl")
    ops, results = _all_reduce_ops(strategy)
    replicas = strategy.num_replicas_in_sync
    assert results == [float(sum(range(1, replicas + 1)))] * replicas
    assert ops["CollectiveReduceV2"] == 0
    # One GPU needs no all-reduce at all; from two on, NCCL ops must appear.
    assert replicas == 1 or ops["NcclAllReduce"] == replicas, dict(ops)


@pytest.mark.skipif(HAS_GPU, reason="checks the CPU-only error")
def test_mirrored_nccl_without_gpus_is_a_clear_error():
    with pytest.raises(StrategyError, match=r"`cross_device_ops='nccl'` needs GPUs"):
        get("mirrored", cross_device_ops="nccl")


def test_default_is_tensorflows_default_strategy():
    strategy = get("default")
    assert strategy is tf.distribute.get_strategy()
    assert not tf.distribute.has_strategy()  # it is what TF uses when no scope is entered
    with strategy.scope():
        variable = tf.Variable(1.0)
    assert not isinstance(variable, tf.distribute.DistributedValues)
