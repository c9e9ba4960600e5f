"""Pipelines of any functional graph (strategies/pipeline/graph.py) against plain Keras on one device.

Each case builds the same model from the same seed twice, trains one in plain Keras and the
other as a pipeline (same data, same order, Adam), and compares the per-epoch losses and
metrics, the final weights (through `merge`), `predict` and `evaluate`, to 1e-5 absolute
plus 1e-5 relative (float32: a pipeline reassociates the micro-batches' sums only). The
graphs are tests/test_partition_graph.py's (the layer split's): branches and a skip over
every cut (residual), encoder-decoder skips (U-Net), raw `keras.ops` calls, two inputs and
two outputs (list and dict, loss weights and metrics per output), a shared layer, nested
models, a Keras mask crossing a cut; and keras-io's small Xception
(image_classification_from_scratch, narrower). Every schedule runs at M in {1, 4} and
`data_parallel` in {1, 2} on the U-Net and the raw-op graph.
"""

import keras
import numpy as np
import pytest
import test_partition_graph as graphs
from _model_helpers import seeded_twins

import tfscale
from tfscale.strategies import BalanceError, PipelineStrategy
from tfscale.strategies._devices import device_key
from tfscale.strategies._placement import device_of

# The fast tier keeps the first N cases of these parametrized tests (conftest.py).
FAST_REPRESENTATIVES = {
    "test_every_schedule_pipelines_a_graph_like_keras": 2,
    "test_two_inputs_two_outputs_with_loss_weights_and_metrics_per_output": 1,
}
RTOL = ATOL = 1e-5
SCHEDULES = {
    "gpipe": {},
    "1f1b": {},
    "interleaved": {"virtual_stages": 2},
    "zb-h1": {},
    "zb-v": {"virtual_stages": 2},
}


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=what)


def assert_like_keras(build, options, x, y, *, epochs=2, batch_size=8, optimizer=None, **compile_kwargs):
    """Plain Keras and the pipeline of `build()` trained alike; returns (strategy, pipelined)."""
    model, twin = seeded_twins(build)
    strategy = PipelineStrategy(**options)
    pipelined = strategy.split(twin)
    histories = []
    for m in (model, pipelined):
        m.compile(optimizer=(optimizer or keras.optimizers.Adam)(0.01), **compile_kwargs)
        fitted = m.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
        histories.append(fitted.history)
    want, got = histories
    assert sorted(got) == sorted(want)
    for key in want:
        _close(got[key], want[key], key)
    merged = strategy.merge(pipelined)
    for i, (a, b) in enumerate(zip(merged.get_weights(), model.get_weights(), strict=True)):
        _close(a, b, f"weight {i}")
    predictions = (
        keras.tree.flatten(m.predict(x, batch_size=batch_size, verbose=0)) for m in (pipelined, model)
    )
    for a, b in zip(*predictions, strict=True):
        _close(a, b, "predict")
    want = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    got = pipelined.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    assert sorted(got) == sorted(want)
    for key in want:
        _close(got[key], want[key], f"evaluate {key}")
    return strategy, pipelined


def _xy(shape, n=32, outputs=4, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, *shape).astype("float32"), rng.randn(n, outputs).astype("float32")


def small_xception():
    """keras-io's image_classification_from_scratch `make_model`, narrower (8-24 filters, 16x16)."""
    layers = keras.layers
    inputs = keras.Input((16, 16, 3))
    x = layers.Rescaling(1.0 / 255)(inputs)
    x = layers.Conv2D(8, 3, strides=2, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    previous = x
    for size in [8, 16, 24]:
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.Activation("relu")(x)
        x = layers.SeparableConv2D(size, 3, padding="same")(x)
        x = layers.BatchNormalization()(x)
        x = layers.MaxPooling2D(3, strides=2, padding="same")(x)
        residual = layers.Conv2D(size, 1, strides=2, padding="same")(previous)
        x = layers.add([x, residual])  # a skip across a cut
        previous = x
    x = layers.SeparableConv2D(32, 3, padding="same")(x)
    x = layers.BatchNormalization()(x)
    x = layers.Activation("relu")(x)
    x = layers.GlobalAveragePooling2D()(x)
    x = layers.Dropout(0.25)(x)
    return keras.Model(inputs, layers.Dense(1)(x), name="xception")


GRAPHS = {"unet": (graphs.unet, (16, 2)), "raw_ops": (graphs.raw_ops, (8,))}
GRID = [
    (name, schedule, m, d)
    for m, d in ((4, 1), (1, 2), (1, 1), (4, 2))
    for schedule in SCHEDULES
    for name in GRAPHS
    if not (schedule == "interleaved" and m == 1)  # interleaved: M a multiple of S
]


@pytest.mark.parametrize(("name", "schedule", "m", "d"), GRID, ids=["-".join(map(str, c)) for c in GRID])
def test_every_schedule_pipelines_a_graph_like_keras(name, schedule, m, d):
    build, shape = GRAPHS[name]
    options = {"num_stages": 2, "num_microbatches": m, "schedule": schedule, "data_parallel": d}
    strategy, pipelined = assert_like_keras(
        build, {**options, **SCHEDULES[schedule]}, *_xy(shape), loss="mse", metrics=["mae"]
    )
    stages = pipelined.stages
    assert len(stages) == 2 * SCHEDULES[schedule].get("virtual_stages", 1)
    # Every layer's variables live on the device of its stage, in every replica.
    for replica in pipelined.replicas:
        for stage in replica:
            for variable in (v for layer in stage.layers for v in layer.weights):
                assert device_key(device_of(variable)) == device_key(stage.device), variable.path
    # The partition names what crosses each cut: the next stage takes what this one gives.
    for before, after in zip(pipelined.partition, pipelined.partition[1:]):
        assert before["gives"] == after["takes"] and before["gives"]
    assert strategy.report(pipelined)


@pytest.mark.slow  # the fast tier keeps two graph cases above; this one has 20 layers
@pytest.mark.parametrize("options", [{}, {"schedule": "zb-h1"}])
def test_keras_io_small_xception_pipelines_like_keras(options):
    # BatchNormalization normalises by the batch: M = 1 (at M > 1 it is refused, tested below).
    x = np.random.RandomState(0).uniform(0, 255, (16, 16, 16, 3)).astype("float32")
    y = np.random.RandomState(1).randn(16, 1).astype("float32")
    # SGD: a Conv2D's bias before BatchNormalization has a gradient of round-off only (the
    # normalisation removes it), which Adam would scale up to its learning rate.
    options = {"num_stages": 2, "num_microbatches": 1, **options}
    _, pipelined = assert_like_keras(
        small_xception, options, x, y, loss="mse", optimizer=keras.optimizers.SGD
    )
    # The residual of a block crosses the cut beside the block's output.
    assert any(len(part["gives"]) > 1 for part in pipelined.partition[:-1])


def test_a_skip_over_every_cut_passes_through_the_stages_between():
    # residual: BatchNorm (M = 1) and Dropout; the stem's output is used by the last layer.
    options = {"num_stages": 3, "num_microbatches": 1, "balance": "uniform"}
    # SGD: a Dense's bias before BatchNormalization has a gradient of round-off only.
    _, pipelined = assert_like_keras(
        graphs.residual, options, *_xy((8,)), loss="mse", optimizer=keras.optimizers.SGD
    )
    parts = pipelined.partition
    assert "stem:0" in parts[0]["gives"] and "stem:0" in parts[1]["takes"] and "stem:0" in parts[1]["gives"]
    assert parts[-1]["gives"] == ["head:0"]


@pytest.mark.parametrize("structure", ["list", "dict"])
def test_two_inputs_two_outputs_with_loss_weights_and_metrics_per_output(structure):
    x, y, compile_kwargs = graphs.two_tower_data(structure)
    options = {"num_stages": 2, "num_microbatches": 4, "schedule": "1f1b", "data_parallel": 2}
    _, pipelined = assert_like_keras(graphs.two_towers(structure), options, x, y, **compile_kwargs)
    assert sorted(pipelined.partition[0]["takes"]) == ["item:0", "user:0"]
    assert sorted(pipelined.partition[-1]["gives"]) == ["kind:0", "score:0"]


def test_sample_weights_per_output_train_like_keras():
    x, y, compile_kwargs = graphs.two_tower_data("dict")
    rng = np.random.RandomState(5)
    weights = {
        "score": rng.uniform(0, 2, 32).astype("float32"),
        "kind": rng.uniform(0, 2, 32).astype("float32"),
    }
    model, twin = seeded_twins(graphs.two_towers("dict"))
    pipelined = PipelineStrategy(num_stages=2, num_microbatches=4).split(twin)
    histories = []
    for m in (model, pipelined):
        m.compile(optimizer=keras.optimizers.Adam(0.01), **compile_kwargs)
        fitted = m.fit(x, y, sample_weight=weights, batch_size=8, epochs=2, shuffle=False, verbose=0)
        histories.append(fitted.history)
    for key in histories[0]:
        _close(histories[1][key], histories[0][key], key)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_shared_layer_with_its_calls_in_one_stage_trains_like_keras(schedule):
    # Calls in order: shared, middle, shared#1 | sum, out. ZB-H1's W takes each call's part.
    _, pipelined = assert_like_keras(
        graphs.shared,
        {"num_stages": 2, "num_microbatches": 4, "schedule": schedule, "balance": [3, 2]},
        *_xy((8,), outputs=3),
        loss="mse",
    )
    assert pipelined.partition[0]["calls"] == ["shared", "middle", "shared#1"]


def test_a_shared_layer_called_in_two_stages_is_refused_in_one_line_with_what_to_do():
    with pytest.raises(
        BalanceError,
        match=r"layer 'shared' is called in stage 0 and in stage 1.*explicit balance.*model_split",
    ) as e:
        PipelineStrategy(num_stages=2, balance=[2, 3]).split(graphs.shared())
    assert "\n" not in str(e.value)


@pytest.mark.slow  # the fast tier keeps the graphs above
def test_nested_models_and_a_mask_crossing_a_cut_train_like_keras():
    x, y = graphs._data()
    z = np.random.RandomState(2).randn(32, 8).astype("float32")
    # Calls: first, inner, inner#1, add | tail: the nested model's two calls in one stage.
    _, pipelined = assert_like_keras(
        graphs.nested,
        {"num_stages": 2, "num_microbatches": 4, "balance": [4, 1]},
        x,
        {"y": y, "z": z},
        loss={"y": "mse", "z": "mae"},
    )
    assert pipelined.partition[1]["calls"] == ["tail"]
    tokens = graphs._tokens()
    target = np.random.RandomState(1).randn(32, 1).astype("float32")
    # The Embedding's mask (a raw not_equal op of the graph) crosses the cut beside its output.
    _, pipelined = assert_like_keras(
        graphs.masked, {"num_stages": 2, "num_microbatches": 4, "balance": [2, 4]}, tokens, target, loss="mse"
    )
    assert len(pipelined.partition[0]["gives"]) == 2


def test_recompute_of_a_graphs_stages_trains_like_keras():
    assert_like_keras(
        graphs.raw_ops,
        {"num_stages": 2, "num_microbatches": 4, "schedule": "1f1b", "recompute": True},
        *_xy((8,)),
        loss="mse",
    )


def test_the_bytes_between_stages_are_every_carried_tensor():
    build, shape = GRAPHS["unet"]
    x, y = _xy(shape, n=16)
    keras.utils.set_random_seed(3)
    pipelined = PipelineStrategy(num_stages=2, num_microbatches=2, balance="uniform").split(build())
    pipelined.compile(optimizer="sgd", loss="mse")
    report = pipelined.plan_report(x[:8], y[:8])
    carried = pipelined.partition[0]["gives"]
    assert len(carried) > 1  # the encoder's skips cross the cut beside the bottom's output
    # One micro-batch of 4 rows: the float32 bytes of every carried tensor.
    outputs = {layer.name: layer.output for layer in pipelined.unsplit_model.layers[1:]}
    want = sum(4 * 4 * int(np.prod(outputs[label.split(":")[0]].shape[1:])) for label in carried)
    assert report.boundary_bytes == [want]
    assert report.activation_bytes_measured == report.activation_bytes_formula == 2 * want * 2


def test_save_weights_of_a_graphs_pipeline_load_into_the_users_model(tmp_path):
    build, shape = GRAPHS["raw_ops"]
    x, y = _xy(shape)
    keras.utils.set_random_seed(3)
    pipelined = PipelineStrategy(num_stages=2, num_microbatches=2).split(build())
    pipelined.compile(optimizer="adam", loss="mse")
    pipelined.fit(x, y, batch_size=8, epochs=1, verbose=0)
    path = tmp_path / "w.weights.h5"
    pipelined.save_weights(path)
    user = build()
    user.load_weights(path)
    # Batches of 32, micro-batches of 16: the width of the tensor the graph adds a (batch, 1)
    # mean to, where Keras's own add needs tfscale.compat.keras_add.
    want, got = (m.predict(x, batch_size=32, verbose=0) for m in (user, pipelined))
    _close(got, want, "predict after load")


def test_batch_norm_at_several_microbatches_or_copies_is_still_refused_in_a_graph():
    with pytest.raises(tfscale.Error, match=r"Layer 'bn0' \(BatchNormalization\) would normalise each micro"):
        PipelineStrategy(num_stages=2, num_microbatches=4).split(graphs.residual())
    copies = PipelineStrategy(num_stages=2, num_microbatches=1, data_parallel=2).split(small_xception())
    copies.compile(optimizer="sgd", loss="mse")
    with pytest.raises(tfscale.Error, match=r"\(BatchNormalization\) would normalise each copy's 1/2"):
        copies.fit(np.zeros((4, 16, 16, 3), "float32"), np.zeros((4, 1), "float32"), verbose=0)
