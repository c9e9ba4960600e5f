"""Pipeline x data parallel and model split x data parallel in one process (4 logical CPUs).

Reference: the unsplit model trained on one device with the same global batch. Tolerance
(issue 12): losses per epoch rtol=1e-5, final weights atol=1e-5 -- float32 round-off, since
the gradient of a global batch is summed over replicas and micro-batches in another order.
"""

import _model_helpers as helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale.callbacks
import tfscale.strategies
from tfscale.strategies import PipelineStrategy, StrategyError
from tfscale.strategies.pipeline import schedules

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_pipeline_x_data_parallel_trains_like_one_device": 1,
    "test_new_schedules_compose_with_data_parallel": 2,
}


RTOL, ATOL = 1e-5, 1e-5
EPOCHS, BATCH, SAMPLES = 2, 16, 32
SEQ, VOCAB, WIDTH = 6, 11, 8


@keras.saving.register_keras_serializable("tfscale_test")
class _Block(keras.layers.Layer):
    """A pre-norm Transformer block: its residuals stay inside, so a model of blocks is a chain."""

    def __init__(self, width, heads, **kwargs):
        super().__init__(**kwargs)
        self.width, self.heads = width, heads
        self.norm1 = keras.layers.LayerNormalization()
        self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
        self.norm2 = keras.layers.LayerNormalization()
        self.up = keras.layers.Dense(2 * width, activation="relu")
        self.down = keras.layers.Dense(width)

    def call(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h)
        return x + self.down(self.up(self.norm2(x)))

    def get_config(self):
        return {**super().get_config(), "width": self.width, "heads": self.heads}


def _transformer():
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, WIDTH),
            _Block(WIDTH, 2),
            _Block(WIDTH, 2),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ],
        name="transformer",
    )


_BUILDERS = {"mlp": helpers.mlp, "transformer": _transformer}


def _model(kind, seed=0):
    return helpers.seeded(_BUILDERS[kind], seed)


def _data(kind, samples=SAMPLES):
    if kind != "transformer":
        return helpers.regression_data((6,), samples)
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, size=(samples, SEQ)).astype("int32")
    return x, rng.normal(size=(samples, 3)).astype("float32")


def _compile(model):
    return helpers.compile_sgd(model, 0.01)


def _fit(model, x, y, **kwargs):
    return helpers.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, **kwargs)


# The unsplit model trained on one device: kind -> (history, final weights), once per kind.
_reference = helpers.reference_runs(_model, _data, _compile, _fit)


def _assert_trains_like_reference(kind, model):
    history, weights = _reference(kind)
    got = _fit(model, *_data(kind))
    np.testing.assert_allclose(got["loss"], history["loss"], rtol=RTOL)
    np.testing.assert_allclose(got["mae"], history["mae"], rtol=RTOL)
    helpers.assert_weights_close(model.get_weights(), weights, rtol=0, atol=ATOL)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
def test_pipeline_x_data_parallel_trains_like_one_device(kind, schedule):
    strategy = tfscale.strategies.get(
        "pipeline", num_stages=2, num_microbatches=2, data_parallel=2, schedule=schedule, balance="uniform"
    )
    pipelined = _compile(strategy.split(_model(kind)))
    _assert_trains_like_reference(kind, pipelined)
    # Every replica ends with the same weights: each applied the same summed gradients.
    for stages in pipelined.replicas[1:]:
        for a, b in zip(_variables(stages), _variables(pipelined.replicas[0])):
            np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize(("schedule", "virtual_stages"), [("zb-h1", 1), ("interleaved", 2), ("zb-v", 2)])
def test_new_schedules_compose_with_data_parallel(schedule, virtual_stages):
    # Issue 16 x issue 12: the schedule only sees one replica's chunks, so zero-bubble and
    # interleaved (S x V chunks, chunk c on device c mod S) and ZB-V (chunks in a V) run
    # per replica unchanged.
    strategy = tfscale.strategies.get(
        "pipeline",
        num_stages=2,
        num_microbatches=2,
        data_parallel=2,
        schedule=schedule,
        virtual_stages=virtual_stages,
        balance="uniform",
    )
    pipelined = _compile(strategy.split(_model("mlp")))
    assert [len(stages) for stages in pipelined.replicas] == [2 * virtual_stages] * 2
    for r, stages in enumerate(pipelined.replicas):
        devices = strategy.replica_devices[r]
        expected = schedules.stage_devices(devices, 2 * virtual_stages, schedule)
        if schedule == "zb-v":
            assert expected == [devices[0], devices[1], devices[1], devices[0]]
        assert [stage.device for stage in stages] == expected
    _assert_trains_like_reference("mlp", pipelined)


def _variables(stages):
    return [v for stage in stages for v in stage.trainable_variables]


def test_each_replica_stage_and_its_slots_live_on_their_own_device():
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, data_parallel=2, balance="uniform")
    pipelined = _compile(strategy.split(_model("mlp")))
    _fit(pipelined, *_data("mlp"))
    devices = tfscale.strategies.split_cpu(4)
    optimizers = pipelined._plan.data_parallel.optimizers
    assert optimizers[0] is pipelined.optimizer
    for r, (stages, optimizer) in enumerate(zip(pipelined.replicas, optimizers)):
        for s, stage in enumerate(stages):
            helpers.assert_stage_placed(stage, devices[r * 2 + s], optimizer)


def test_replicas_resync_after_set_weights():
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, data_parallel=2)
    pipelined = _compile(strategy.split(_model("mlp")))
    pipelined.set_weights([w + 1.0 for w in pipelined.get_weights()])
    for a, b in zip(_variables(pipelined.replicas[1]), _variables(pipelined.replicas[0])):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_bad_data_parallel_input_is_one_line_error():
    # Starts TensorFlow's runtime, so the host CPU stays split into conftest's 4 devices
    # (before that, a strategy could still split it into 8).
    assert len(tf.config.list_logical_devices("CPU")) == 4
    with pytest.raises(StrategyError, match=r"data_parallel=4 x num_stages=2 = 8 devices, more than the 4"):
        PipelineStrategy(num_stages=2, data_parallel=4)
    with pytest.raises(StrategyError, match=r"`data_parallel`.*data_parallel=0"):
        PipelineStrategy(num_stages=2, data_parallel=0)
    with pytest.raises(StrategyError, match=r"data_parallel=4 x num_devices=2 = 8 devices, more than the 4"):
        tfscale.strategies.get("model_split", num_devices=2, data_parallel=4)
    with pytest.raises(StrategyError, match=r"3 devices for data_parallel=2"):
        tfscale.strategies.get("model_split", devices=["/cpu:0", "/cpu:1", "/cpu:2"], data_parallel=2)


def _split_mlp():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(4),
        ],
        name="split_mlp",
    )


_BUILDERS["split_mlp"] = _split_mlp


@pytest.mark.parametrize("tensor_parallel", [True, False], ids=["tensor", "layer"])
def test_model_split_x_data_parallel_trains_like_one_device(tensor_parallel, tmp_path):
    x, _ = _data("mlp")
    y = np.random.default_rng(2).normal(size=(SAMPLES, 4)).astype("float32")
    with tf.device("/device:CPU:0"):
        reference = _compile(_model("split_mlp"))
        expected = _fit(reference, x, y)
    strategy = tfscale.strategies.get(
        "model_split", num_devices=2, tensor_parallel=tensor_parallel, data_parallel=2
    )
    split = _compile(strategy.split(_model("split_mlp")))
    got = _fit(split, x, y)
    np.testing.assert_allclose(got["loss"], expected["loss"], rtol=RTOL)
    merged = strategy.merge(split)
    for a, b in zip(merged.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)
    # Replica r's parts live on devices 2r and 2r+1, each copy holding its share.
    rows = strategy.report(split)
    assert [row["device"] for row in rows] == tfscale.strategies.split_cpu(4)
    assert all(row["params"] > 0 for row in rows)
    assert rows[0]["params"] + rows[1]["params"] == rows[2]["params"] + rows[3]["params"]
    if not tensor_parallel:  # A layer split's weights file is the user's model's.
        path = str(tmp_path / "split.weights.h5")
        split.save_weights(path)
        unsplit = _model("split_mlp", seed=5)
        unsplit.load_weights(path)
        for a, b in zip(unsplit.get_weights(), reference.get_weights()):
            np.testing.assert_allclose(a, b, rtol=0, atol=ATOL)


@helpers.each_backup_class
def test_backup_and_restore_of_pipeline_x_data_parallel(tmp_path, backup_class):
    x, y = _data("mlp")
    expected, weights = _reference("mlp")
    backup = backup_class(str(tmp_path / "backup"))
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, data_parallel=2, balance="uniform")
    second, history = helpers.interrupted_then_resumed(
        _compile(strategy.split(_model("mlp"))),
        # A fresh hybrid model from other weights: only the restore (into every replica) fixes it.
        lambda: _compile(strategy.split(_model("mlp", seed=3))),
        backup,
        lambda model, callbacks: _fit(model, x, y, callbacks=callbacks),
    )
    np.testing.assert_allclose(history["loss"], expected["loss"][1:], rtol=RTOL)
    helpers.assert_weights_close(second.get_weights(), weights, rtol=0, atol=ATOL)
    path = str(tmp_path / "hybrid.weights.h5")
    second.save_weights(path)
    unsplit = _model("mlp", seed=4)
    unsplit.load_weights(path)
    for a, b in zip(unsplit.get_weights(), second.get_weights()):
        np.testing.assert_array_equal(a, b)
