"""Layer split of any functional graph (strategies/_graph.py, model_split/graph.py) against plain Keras.

Each case builds the same model from the same seed twice, trains one in plain Keras on one
device and the other split over devices (same data, same order, Adam), and compares the
per-epoch losses and metrics, the final weights (through `merge`), `predict` and
`evaluate`. Tolerance: 1e-5 absolute plus 1e-5 relative (float32; a split only moves the
computation, the sums are the same). The graphs: branches and skip connections crossing
every cut, an encoder-decoder (U-Net) skip, two inputs and two outputs (list and dict, with
loss weights and per-output metrics), a shared layer called in two parts, raw `keras.ops`
calls between layers, nested models (a functional one called twice, a Sequential), a Keras
mask crossing a cut, and the mask of a per-timestep output
leaving the last part for the loss; and `data_parallel=2` copies of a graph split.
"""

import keras
import numpy as np
import pytest
from _model_helpers import seeded_twins

from tfscale.strategies import BalanceError, ModelSplitStrategy
from tfscale.strategies._placement import device_of

# The fast tier keeps the first N cases of these parametrized tests (the residual graph on 2
# devices); the rest run in the full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_layer_split_of_a_graph_trains_like_keras": 1,
    "test_two_inputs_two_outputs_with_loss_weights_and_metrics_per_output": 1,
}
RTOL = ATOL = 1e-5
DEVICES = [f"/device:CPU:{i}" for i in range(4)]
SEQ, VOCAB = 7, 16


def _close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=what)


def assert_like_keras(build, options, x, y, *, epochs=2, **compile_kwargs):
    """Plain Keras and the split of `build()` trained alike; returns (strategy, split)."""
    model, twin = seeded_twins(build)
    strategy = ModelSplitStrategy(**options)
    split = strategy.split(twin)
    histories = []
    for m in (model, split):
        m.compile(optimizer=keras.optimizers.Adam(0.01), **compile_kwargs)
        fitted = m.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
        histories.append(fitted.history)
    want, got = histories
    assert sorted(got) == sorted(want)
    for key in want:
        _close(got[key], want[key], key)
    for i, (a, b) in enumerate(zip(strategy.merge(split).get_weights(), model.get_weights(), strict=True)):
        _close(a, b, f"weight {i}")
    for a, b in zip(*(keras.tree.flatten(m.predict(x, verbose=0)) for m in (split, model)), strict=True):
        _close(a, b, "predict")
    want = model.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    got = split.evaluate(x, y, batch_size=8, verbose=0, return_dict=True)
    assert sorted(got) == sorted(want)
    for key in want:
        _close(got[key], want[key], f"evaluate {key}")
    return strategy, split


def _data(n=32, features=8, outputs=4, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, features).astype("float32"), rng.randn(n, outputs).astype("float32")


def _tokens():
    """Padded token rows (0 = padding, at the end of each row)."""
    rng = np.random.RandomState(0)
    x = rng.randint(1, VOCAB, (32, SEQ)).astype("int32")
    for i, length in enumerate(rng.randint(2, SEQ, 32)):
        x[i, length:] = 0
    return x


def residual():
    """Residual blocks (Dense, BatchNorm, Dropout) and a stem output every later part uses."""
    x = keras.Input((8,))
    stem = keras.layers.Dense(16, activation="relu", name="stem")(x)
    h = stem
    for i in range(3):
        a = keras.layers.Dense(16, activation="relu", name=f"a{i}")(h)
        a = keras.layers.BatchNormalization(name=f"bn{i}")(a)
        a = keras.layers.Dropout(0.25, seed=i, name=f"drop{i}")(a)
        h = keras.layers.Add(name=f"add{i}")([h, keras.layers.Dense(16, name=f"b{i}")(a)])
    left, right = keras.layers.Dense(8, name="left")(h), keras.layers.Dense(8, name="right")(h)
    joined = keras.layers.Concatenate(name="cat")([left, right, stem])  # stem: a skip over every cut
    return keras.Model(x, keras.layers.Dense(4, name="head")(joined), name="residual")


def unet():
    """Conv encoder-decoder whose decoder takes the encoder's outputs (U-Net skips)."""
    x = keras.Input((16, 2))
    e1 = keras.layers.Conv1D(4, 3, padding="same", activation="relu", name="enc1")(x)
    e2 = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="enc2")(
        keras.layers.MaxPooling1D(name="pool1")(e1)
    )
    bottom = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="bottom")(
        keras.layers.MaxPooling1D(name="pool2")(e2)
    )
    d2 = keras.layers.Concatenate(name="skip2")([keras.layers.UpSampling1D(name="up2")(bottom), e2])
    d2 = keras.layers.Conv1D(8, 3, padding="same", activation="relu", name="dec2")(d2)
    d1 = keras.layers.Concatenate(name="skip1")([keras.layers.UpSampling1D(name="up1")(d2), e1])
    out = keras.layers.Conv1D(4, 3, padding="same", name="dec1")(d1)
    return keras.Model(x, keras.layers.GlobalAveragePooling1D(name="gap")(out), name="unet")


def raw_ops():
    """Raw keras.ops calls between layers, some of them on the model's input (a skip)."""
    x = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(x)
    h = keras.ops.tanh(h) * 2.0 + keras.ops.mean(x, axis=-1, keepdims=True)
    h = keras.layers.Dense(16, name="d2")(h)
    h = keras.ops.concatenate([keras.ops.relu(h), keras.ops.square(x)], axis=-1)
    return keras.Model(x, keras.layers.Dense(4, name="out")(h), name="raw_ops")


GRAPHS = {"residual": (residual, (8,)), "unet": (unet, (16, 2)), "raw_ops": (raw_ops, (8,))}


@pytest.mark.parametrize("name", list(GRAPHS))
@pytest.mark.parametrize("num_devices", [2, 3])
def test_layer_split_of_a_graph_trains_like_keras(name, num_devices):
    build, shape = GRAPHS[name]
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, *shape).astype("float32"), rng.randn(32, 4).astype("float32")
    strategy, split = assert_like_keras(
        build, {"num_devices": num_devices, "balance": "uniform"}, x, y, loss="mse", metrics=["mae"]
    )
    parts = strategy.placement
    assert [part["device"] for part in parts] == DEVICES[:num_devices]
    # Every layer's variables live on the device of its part.
    for part in parts:
        for layer in part["layers"]:
            assert {device_of(v) for v in split.get_layer(layer).weights} <= {part["device"]}, layer
    # A cut carries what the next part takes.
    for before, after in zip(parts, parts[1:]):
        assert before["gives"] == after["takes"]


@pytest.mark.slow  # the fast tier keeps one graph, the two-output and the shared-layer splits
def test_a_skip_passes_through_every_cut_it_spans_and_the_report_shows_it():
    strategy, split = assert_like_keras(
        residual, {"num_devices": 3, "balance": "uniform"}, *_data(), loss="mse", epochs=1
    )
    parts = strategy.placement
    assert len(parts[0]["takes"]) == 1  # the model's input
    assert "stem:0" in parts[0]["gives"] and "stem:0" in parts[1]["gives"]  # made in 0, used in 2
    rows = strategy.report(split)
    assert [row["gives"] for row in rows] == [part["gives"] for part in parts]
    assert rows[-1]["gives"] == ["head:0"]


def two_towers(structure):
    def build():
        user, item = keras.Input((6,), name="user"), keras.Input((5,), name="item")
        hu = keras.layers.Dense(12, activation="relu", name="user_tower")(user)
        hi = keras.layers.Dense(12, activation="relu", name="item_tower")(item)
        h = keras.layers.Dense(16, activation="relu", name="mix")(
            keras.layers.Concatenate(name="joint")([hu, hi])
        )
        score = keras.layers.Dense(1, name="score")(h)
        residual = keras.layers.Add(name="res")([h, keras.layers.Dense(16, name="proj")(hu)])
        kind = keras.layers.Dense(3, activation="softmax", name="kind")(residual)
        if structure == "dict":
            return keras.Model({"user": user, "item": item}, {"score": score, "kind": kind})
        return keras.Model([user, item], [score, kind])

    return build


def two_tower_data(structure):
    """(x, y, compile keyword arguments) for `two_towers(structure)`: a loss, a loss weight
    and a metric per output, as a list or a dict by output name."""
    rng = np.random.RandomState(1)
    user, item = rng.randn(32, 6).astype("float32"), rng.randn(32, 5).astype("float32")
    score, kind = rng.randn(32, 1).astype("float32"), rng.randint(0, 3, (32,)).astype("int32")
    losses, weights, metrics = ("mse", "sparse_categorical_crossentropy"), (0.5, 2.0), (["mae"], ["accuracy"])
    if structure == "dict":
        names = ("score", "kind")
        compile_kwargs = {
            "loss": dict(zip(names, losses)),
            "loss_weights": dict(zip(names, weights)),
            "metrics": dict(zip(names, metrics)),
        }
        return {"user": user, "item": item}, dict(zip(names, (score, kind))), compile_kwargs
    compile_kwargs = {"loss": list(losses), "loss_weights": list(weights), "metrics": list(metrics)}
    return [user, item], [score, kind], compile_kwargs


@pytest.mark.parametrize("structure", ["list", "dict"])
def test_two_inputs_two_outputs_with_loss_weights_and_metrics_per_output(structure):
    x, y, compile_kwargs = two_tower_data(structure)
    strategy, _ = assert_like_keras(two_towers(structure), {"num_devices": 3}, x, y, **compile_kwargs)
    assert sorted(strategy.placement[0]["takes"]) == ["item:0", "user:0"]
    assert sorted(strategy.placement[-1]["gives"]) == ["kind:0", "score:0"]


def shared():
    x = keras.Input((8,))
    tied = keras.layers.Dense(8, activation="tanh", name="shared")
    first = tied(x)
    second = tied(keras.layers.Dense(8, name="middle")(first))
    return keras.Model(x, keras.layers.Dense(3, name="out")(keras.layers.Add(name="sum")([first, second])))


def test_a_shared_layer_called_in_two_parts_is_placed_once_and_reported():
    x, y = _data(outputs=3)
    # Calls in order: shared, middle | shared#1, sum, out.
    strategy, split = assert_like_keras(shared, {"num_devices": 2, "balance": [2, 3]}, x, y, loss="mse")
    first, second = strategy.placement
    assert first["calls"] == ["shared", "middle"] and second["calls"] == ["shared#1", "sum", "out"]
    assert "shared" in first["layers"] and "shared" not in second["layers"]
    assert second["shared"] == {"shared": DEVICES[0]}
    assert {device_of(v) for v in split.get_layer("shared").weights} == {DEVICES[0]}
    assert strategy.report(split)[1]["shared"] == {"shared": DEVICES[0]}
    assert sorted(first["gives"]) == ["middle:0", "shared:0"]  # the first call's output crosses too


def nested():
    """A functional model called twice (its second output a model output) and a Sequential, nested."""
    inner_input = keras.Input((8,))
    inner = keras.Model(
        inner_input, keras.layers.Dense(8, activation="tanh", name="inner_d")(inner_input), name="inner"
    )
    tail = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4, name="tail_d")], name="tail")
    x = keras.Input((8,))
    h = keras.layers.Dense(8, name="first")(x)
    a = inner(h)
    return keras.Model(x, {"y": tail(keras.layers.Add(name="add")([a, h])), "z": inner(a)})


@pytest.mark.slow  # the fast tier keeps one graph, the two-output and the shared-layer splits
def test_nested_models_are_units_and_a_nested_model_called_twice_is_placed_once():
    x, y = _data()
    z = np.random.RandomState(2).randn(32, 8).astype("float32")
    strategy, _ = assert_like_keras(
        nested, {"num_devices": 2, "balance": "uniform"}, x, {"y": y, "z": z}, loss={"y": "mse", "z": "mae"}
    )
    first, second = strategy.placement
    assert first["calls"] == ["first", "inner"] and second["calls"] == ["inner#1", "add", "tail"]
    assert second["shared"] == {"inner": DEVICES[0]} and sorted(second["gives"]) == ["inner#1:0", "tail:0"]


def masked():
    ids = keras.Input((SEQ,), dtype="int32")
    embedded = keras.layers.Embedding(VOCAB, 8, mask_zero=True, name="embed")(ids)
    recurrent = keras.layers.LSTM(6, name="lstm")(embedded)
    pooled = keras.layers.GlobalAveragePooling1D(name="pool")(embedded)  # averages unmasked steps
    return keras.Model(
        ids, keras.layers.Dense(1, name="out")(keras.layers.Concatenate(name="cat")([recurrent, pooled]))
    )


@pytest.mark.slow  # the fast tier keeps one graph, the two-output and the shared-layer splits
def test_a_keras_mask_crosses_a_cut_to_both_branches():
    x = _tokens()
    y = np.random.RandomState(1).randn(32, 1).astype("float32")
    # Calls: embed, not_equal (the Embedding's mask, a raw op of the graph) | lstm, pool, cat, out.
    strategy, _ = assert_like_keras(masked, {"num_devices": 2, "balance": [2, 4]}, x, y, loss="mse")
    first, second = strategy.placement
    assert first["calls"][0] == "embed" and first["calls"][1].startswith("not_equal")
    assert second["takes"] == first["gives"] and first["gives"][0] == "embed:0" and len(first["gives"]) == 2


def masked_sequence():
    ids = keras.Input((SEQ,), dtype="int32")
    embedded = keras.layers.Embedding(VOCAB, 8, mask_zero=True, name="embed")(ids)
    recurrent = keras.layers.GRU(8, return_sequences=True, name="gru")(embedded)
    summed = keras.layers.Add(name="res")([embedded, recurrent])
    return keras.Model(ids, keras.layers.Dense(1, name="out")(summed))


@pytest.mark.slow  # the fast tier keeps one graph, the two-output and the shared-layer splits
def test_the_mask_of_a_per_timestep_output_leaves_the_last_part_for_the_loss():
    x = _tokens()
    y = np.random.RandomState(1).randn(32, SEQ, 1).astype("float32")
    strategy, _ = assert_like_keras(
        masked_sequence, {"num_devices": 2, "balance": "uniform"}, x, y, loss="mse"
    )
    assert "out" in strategy.placement[-1]["calls"]


@pytest.mark.slow  # the fast tier keeps one graph, the two-output and the shared-layer splits
def test_data_parallel_copies_of_a_graph_split_train_like_keras():
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, 16, 2).astype("float32"), rng.randn(32, 4).astype("float32")
    assert_like_keras(unet, {"num_devices": 2, "data_parallel": 2}, x, y, loss="mse", metrics=["mae"])


def test_a_subclassed_model_is_refused_in_one_line_with_what_to_do():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    net = Net()
    with pytest.raises(
        BalanceError, match=r"'net' of class Net by layers: its call\(\) is Python.*functional"
    ) as e:
        ModelSplitStrategy(num_devices=2).split(net)
    assert "\n" not in str(e.value)


def test_balance_time_on_a_graph_is_refused_in_one_line():
    with pytest.raises(BalanceError, match=r"balance='time' for model 'residual'.*'parameters', 'uniform'"):
        ModelSplitStrategy(num_devices=2, balance="time").split(residual(), sample_input=_data()[0])


def residual_tail():
    """Two Dense layers, their sum (no parameters), two more: two cuts that balance alike."""
    x = keras.Input((8,))
    a = keras.layers.Dense(32, name="a")(x)  # 288 parameters
    b = keras.layers.Dense(32, name="b")(a)  # 1056
    h = keras.layers.Dense(32, name="c")(keras.layers.Add(name="sum")([a, b]))  # 1056
    return keras.Model(x, keras.layers.Dense(4, name="out")(h))  # 132


def test_of_cuts_that_balance_alike_the_one_carrying_fewer_bytes_is_taken():
    # By parameters, "a, b | sum, c, out" and "a, b, sum | c, out" have the same largest part
    # (1344); the first carries a and b (2 x 32 floats a sample), the second only their sum.
    strategy = ModelSplitStrategy(num_devices=2, balance="parameters")
    strategy.split(residual_tail())
    first, second = strategy.placement
    assert first["calls"] == ["a", "b", "sum"] and first["gives"] == ["sum:0"]
    assert first["gives_bytes"] == 32 * 4 and second["gives_bytes"] is None
