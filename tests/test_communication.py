"""Gradient all-reduce options (strategies/_communication.py): compression and packing reach Keras."""

import _optimizer_workers as workers
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.strategies import StrategyError, get
from tfscale.strategies._communication import traced_all_reduces

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_compression_sends_half_the_bytes": 1,
}


def _traced_step_launches(strategy, option="plain"):
    """Launches of one traced training step (per replica), after fit built the model."""
    x, y = workers.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(workers.GLOBAL_BATCH)
    with strategy.scope():
        model = workers.build_model(workers.OPTIONS[option])
    model.fit(dataset.take(1), verbose=0)
    batch = next(iter(strategy.experimental_distribute_dataset(dataset)))
    step = tf.function(lambda b: strategy.run(model.train_step, args=(b,)))
    launches = traced_all_reduces(step.get_concrete_function(batch).graph)
    replicas = strategy.num_replicas_in_sync
    assert len(launches) % replicas == 0
    return launches[: len(launches) // replicas]


def _gradient_bytes():
    model = workers.build_model({})
    return sum(int(np.prod(w.shape)) * 4 for w in model.trainable_weights)


@pytest.mark.parametrize(
    ("compression", "dtype", "ratio"),
    [(None, "float32", 1.0), ("fp16", "float16", 0.5), ("bf16", "bfloat16", 0.5)],
)
def test_compression_sends_half_the_bytes(compression, dtype, ratio):
    launches = _traced_step_launches(get("mirrored", cpu_replicas=2, gradient_compression=compression))
    assert [d for d, _ in launches] == [dtype]
    assert sum(b for _, b in launches) == ratio * _gradient_bytes()


def test_bytes_per_pack_splits_the_all_reduce_into_launches():
    one_pack = _traced_step_launches(get("mirrored", cpu_replicas=2))
    assert len(one_pack) == 1
    # TensorFlow closes a pack once it holds >= bytes_per_pack, walking the gradients
    # (512, 64, 128, 8 bytes) backwards: 64 -> [8+128][64+512]; 1 -> one each.
    for bytes_per_pack, launches in ((64, 2), (1, 4)):
        packed = _traced_step_launches(get("mirrored", cpu_replicas=2, bytes_per_pack=bytes_per_pack))
        assert len(packed) == launches
        assert sum(b for _, b in packed) == sum(b for _, b in one_pack)


def test_accumulation_steps_communicate_nothing_outside_the_update_branch():
    # With k=2 the all-reduce sits in the update branch of the optimizer's cond:
    # the step's own graph launches nothing; the branch launches one pack.
    assert _traced_step_launches(get("mirrored", cpu_replicas=2), "accumulation") == []


def _final_loss(**options):
    x, y = workers.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(workers.GLOBAL_BATCH)
    strategy = get("mirrored", cpu_replicas=2, **options)
    with strategy.scope():
        model = workers.build_model({})
    return model.fit(dataset, epochs=4, verbose=0).history["loss"][-1]


@pytest.fixture(scope="module")
def uncompressed_loss():
    """The reference, trained once for every compression compared with it."""
    return _final_loss()


@pytest.mark.parametrize("compression", ["fp16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_compressed_training_loss_within_one_percent(compression, uncompressed_loss):
    loss = _final_loss(gradient_compression=compression)
    assert abs(loss - uncompressed_loss) < 0.01 * uncompressed_loss


def _train_huge_gradients(compression):
    # Targets of 1e5 make the gradients ~1e6, beyond fp16's 65504: a compressed sum
    # would be inf. The tiny learning rate keeps the weights finite in fp32.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8)).astype("float32")
    y = np.full((32, 1), 1e5, "float32")
    strategy = get("mirrored", cpu_replicas=2, gradient_compression=compression)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(1e-9), loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    return model.get_weights()


def test_fp16_overflow_falls_back_to_uncompressed_instead_of_inf():
    got = _train_huge_gradients("fp16")
    assert all(np.isfinite(w).all() for w in got)
    for g, w in zip(got, _train_huge_gradients(None)):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"gradient_compression": "int8"}, "gradient_compression='int8'"),
        ({"bytes_per_pack": -1}, "bytes_per_pack=-1"),
        ({"bytes_per_pack": 1.5}, "bytes_per_pack=1.5"),
        ({"timeout_seconds": 0}, "timeout_seconds=0"),
    ],
)
def test_bad_options_name_the_value(options, match):
    with pytest.raises(StrategyError, match=match):
        get("mirrored", cpu_replicas=2, **options)


def test_compat_reads_the_options_a_strategy_was_built_with_and_those_tfscale_attaches():
    """tfscale.compat.tf_communication's gate: the private `extended._communication_options`."""
    from tfscale.compat import tf_communication
    from tfscale.strategies import configure_communication

    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"],
        cross_device_ops=None,
    )
    own = strategy.extended._communication_options
    assert (
        tf_communication.attached(strategy) is None and tf_communication.compression_dtype(strategy) is None
    )
    assert tf_communication.options(strategy).bytes_per_pack == own.bytes_per_pack == 0
    configure_communication(strategy, gradient_compression="bf16", bytes_per_pack=64, timeout_seconds=9.0)
    assert tf_communication.compression_dtype(strategy) == tf.bfloat16
    merged = tf_communication.options(strategy)
    assert (merged.bytes_per_pack, merged.timeout_seconds) == (64, 9.0)
    assert own.bytes_per_pack == 0  # merged into a copy, the strategy's own left as built
