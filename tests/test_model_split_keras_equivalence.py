"""Model split (layer split, tensor split) against plain Keras on one device: issue 24's cases.

Each case trains the same model (same initial weights, data order, optimizer) once in plain
Keras on one device and once split, and compares per-epoch losses, final weights (through
`merge`) and predictions. Tolerance: float32 round-off, 1e-5 (a split only reorders sums:
row-split partial products, per-shard squared norms). Anything a split cannot do exactly is
refused in one line before the first step; those cases check the message.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _model_helpers import seeded_twins

from tfscale.strategies import ModelSplitError, ModelSplitStrategy

RTOL, ATOL = 1e-5, 1e-5
VOCAB, SEQ = 16, 7
# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {"test_layer_split_carries_the_embedding_mask_to_the_rnn": 1}


def _tokens(n=32, seed=0):
    """Padded token rows (0 = padding, at the end of each row), and a target per row."""
    rng = np.random.RandomState(seed)
    x = rng.randint(1, VOCAB, (n, SEQ)).astype("int32")
    for i, length in enumerate(rng.randint(2, SEQ, n)):
        x[i, length:] = 0
    return x, rng.randn(n, 1).astype("float32")


def _dense_data(n=32, features=8, outputs=4, seed=0):
    rng = np.random.RandomState(seed)
    return rng.randn(n, features).astype("float32"), rng.randn(n, outputs).astype("float32")


def _fit(model, x, y, optimizer, loss="mse", epochs=2, batch_size=8, **compile_kwargs):
    model.compile(optimizer=optimizer, loss=loss, **compile_kwargs)
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history


def _optimizer(spec):
    """A fresh optimizer from a name or a function that makes one."""
    return spec() if callable(spec) else keras.optimizers.get(spec)


def assert_like_keras(build, options, x, y, optimizer, **fit_kwargs):
    """Trains `build()` in plain Keras and split by `options`; losses, weights and predictions agree."""
    model, twin = seeded_twins(build)
    strategy = ModelSplitStrategy(**options)
    split = strategy.split(twin)
    want = _fit(model, x, y, _optimizer(optimizer), **fit_kwargs)
    got = _fit(split, x, y, _optimizer(optimizer), **fit_kwargs)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, err_msg=key)
    merged = strategy.merge(split)
    for a, b in zip(merged.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    got, want = (keras.tree.flatten(m.predict(x, verbose=0)) for m in (split, model))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    return strategy, split, model


# Case 2: a Keras mask crosses the device hops of a layer split.


def embedding_lstm(rnn):
    def build():
        return keras.Sequential(
            [
                keras.Input((SEQ,), dtype="int32"),
                keras.layers.Embedding(VOCAB, 8, mask_zero=True),
                rnn(),
                keras.layers.Dense(1),
            ]
        )

    return build


RNNS = {
    "lstm": lambda: keras.layers.LSTM(6),
    "gru": lambda: keras.layers.GRU(6),
    "bidirectional": lambda: keras.layers.Bidirectional(keras.layers.LSTM(4)),
}


@pytest.mark.parametrize("rnn", list(RNNS))
def test_layer_split_carries_the_embedding_mask_to_the_rnn(rnn):
    strategy, _, _ = assert_like_keras(
        embedding_lstm(RNNS[rnn]), {"num_devices": 2, "balance": [1, 2]}, *_tokens(), "adam"
    )
    assert [len(part["layers"]) for part in strategy.placement] == [1, 2]


@pytest.mark.slow
def test_tensor_split_keeps_the_embedding_mask_for_the_rnn():
    assert_like_keras(embedding_lstm(RNNS["lstm"]), {"tensor_parallel": 2}, *_tokens(), "adam")


@pytest.mark.slow
def test_layer_split_carries_a_masking_layer_mask_through_every_hop():
    def build():
        return keras.Sequential(
            [
                keras.Input((SEQ, 3)),
                keras.layers.Masking(0.0),
                keras.layers.Dense(5),
                keras.layers.LSTM(4),
                keras.layers.Dense(1),
            ]
        )

    x, y = _tokens()
    features = np.repeat(x[..., None].astype("float32") / VOCAB, 3, axis=-1)
    assert_like_keras(build, {"num_devices": 4}, features, y, "adam")


def test_layer_split_keeps_the_mask_of_a_per_timestep_output_for_the_loss():
    def build():
        return keras.Sequential(
            [
                keras.Input((SEQ,), dtype="int32"),
                keras.layers.Embedding(VOCAB, 8, mask_zero=True),
                keras.layers.LSTM(6, return_sequences=True),
                keras.layers.Dense(2),
            ]
        )

    x, _ = _tokens()
    y = np.random.RandomState(1).randn(len(x), SEQ, 2).astype("float32")
    assert_like_keras(build, {"num_devices": 3}, x, y, "adam")


# Case 4: tensor split keeps `trainable=False` (a frozen pretrained layer), and follows changes.


def frozen_encoder():
    ids = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, 8, trainable=False, name="embed")(ids)
    x = keras.layers.Dense(8, activation="relu", trainable=False, name="frozen")(x)
    x = keras.layers.Dense(4, activation="relu", name="hidden")(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(ids, keras.layers.Dense(2, name="head")(x))


def test_tensor_split_keeps_frozen_layers_frozen():
    x, y = _tokens()
    y = np.repeat(y, 2, axis=-1)
    _, split, model = assert_like_keras(frozen_encoder, {"tensor_parallel": 2}, x, y, "adam")
    assert not split.get_layer("embed").trainable and not split.get_layer("frozen").trainable
    assert len(split.trainable_weights) == 2 * len(model.trainable_weights)  # two shards each
    # Unfreezing later (then compiling again, as Keras asks) trains them, as in Keras.
    for m in (split, model):
        m.get_layer("embed").trainable = True
    want = _fit(model, x, y, keras.optimizers.Adam())["loss"]
    got = _fit(split, x, y, keras.optimizers.Adam())["loss"]
    np.testing.assert_allclose(got, want, rtol=RTOL)


# Case 5: clipping by norm is per whole variable; whole-variable optimizers are refused.


def wide_mlp():
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)]
    )


CLIPPED = {
    "sgd-clipnorm": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05),
    "adam-clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.05),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.05),
    "clipvalue": lambda: keras.optimizers.SGD(0.5, clipvalue=0.01),
    "clipnorm-accumulated": lambda: keras.optimizers.SGD(0.5, clipnorm=0.05, gradient_accumulation_steps=2),
    "clipnorm-loss-scaled": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5, clipnorm=0.05)
    ),
}


SLOW_CLIPPED = ("clipnorm-accumulated", "clipvalue", "global_clipnorm")


@pytest.mark.parametrize(
    "optimizer",
    [pytest.param(o, marks=pytest.mark.slow) if o in SLOW_CLIPPED else o for o in sorted(CLIPPED)],
)
def test_tensor_split_clips_each_whole_variable(optimizer):
    assert_like_keras(wide_mlp, {"tensor_parallel": 2}, *_dense_data(), CLIPPED[optimizer])


def test_tensor_split_data_parallel_clips_each_whole_variable_in_every_copy():
    options = {"tensor_parallel": 2, "data_parallel": 2}
    assert_like_keras(wide_mlp, options, *_dense_data(), CLIPPED["adam-clipnorm"])


@pytest.mark.parametrize(
    "optimizer",
    [keras.optimizers.Adafactor(), keras.optimizers.Lamb(), keras.optimizers.Muon()],
    ids=lambda o: type(o).__name__,
)
def test_tensor_split_refuses_optimizers_that_need_the_whole_variable(optimizer):
    split = ModelSplitStrategy(tensor_parallel=2).split(wide_mlp())
    name = type(optimizer).__name__
    with pytest.raises(ModelSplitError, match=rf"^Cannot train .* with {name}: .*Expected") as error:
        split.compile(optimizer=optimizer, loss="mse")
    assert "\n" not in str(error.value)
    # Layer split holds whole variables: the same optimizer is fine there.
    ModelSplitStrategy(num_devices=2).split(wide_mlp()).compile(optimizer=optimizer, loss="mse")


# Case 10: layer split with data_parallel=2 logs the whole batch's penalty once.


def regularized_mlp():
    return keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.L2(0.1)),
            keras.layers.Dense(8, activity_regularizer=keras.regularizers.L2(0.05)),
            keras.layers.Dense(4, bias_regularizer=keras.regularizers.L1(0.1)),
        ]
    )


def test_layer_split_data_parallel_logs_the_penalty_of_the_whole_batch():
    x, y = _dense_data()
    assert_like_keras(regularized_mlp, {"num_devices": 2, "data_parallel": 2}, x, y, "sgd")


# Case 12: dict outputs with loss_weights; raw keras.ops between layers.


def dict_chain():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(inputs, {"score": keras.layers.Dense(4, name="score")(hidden)})


def two_heads():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu", name="hidden")(inputs)
    return keras.Model(
        inputs,
        {"a": keras.layers.Dense(4, name="a")(hidden), "b": keras.layers.Dense(2, name="b")(hidden)},
    )


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_layer_split_of_a_dict_output_with_loss_weights(data_parallel):
    x, y = _dense_data()
    assert_like_keras(
        dict_chain,
        {"num_devices": 2, "data_parallel": data_parallel},
        x,
        {"score": y},
        "adam",
        loss={"score": "mse"},
        loss_weights={"score": 0.5},
    )


@pytest.mark.parametrize("data_parallel", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tensor_split_of_dict_outputs_with_loss_weights(data_parallel):
    x, y = _dense_data()
    targets = {"a": y, "b": y[:, :2]}
    assert_like_keras(
        two_heads,
        {"tensor_parallel": 2, "data_parallel": data_parallel},
        x,
        targets,
        "adam",
        loss={"a": "mse", "b": "mae"},
        loss_weights={"a": 0.3, "b": 2.0},
    )


def raw_op_chain():
    inputs = keras.Input((8,))
    hidden = keras.ops.tanh(keras.layers.Dense(8, name="hidden")(inputs))
    return keras.Model(inputs, keras.layers.Dense(4, name="out")(hidden))


def test_layer_split_of_a_raw_op_between_layers():
    strategy, _, _ = assert_like_keras(
        raw_op_chain, {"num_devices": 2, "balance": [2, 1]}, *_dense_data(), "adam"
    )
    assert strategy.placement[0]["calls"][1].startswith("tanh") and strategy.placement[1]["calls"] == ["out"]


def test_tensor_split_of_a_raw_op_between_layers():
    assert_like_keras(raw_op_chain, {"tensor_parallel": 2}, *_dense_data(), "adam")


# The model's life around fit: weights in the unsplit layout, save and load.


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_tensor_split_weights_are_in_the_unsplit_layout(tmp_path, data_parallel):
    keras.utils.set_random_seed(4)
    model, x = frozen_encoder(), _tokens()[0]
    strategy = ModelSplitStrategy(tensor_parallel=2, data_parallel=data_parallel)
    split = strategy.split(frozen_encoder())
    split.set_weights(model.get_weights())
    for a, b in zip(split.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(split.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    with pytest.raises(ModelSplitError, match=r"`weights` .* received 1 arrays .*Expected 7 arrays"):
        split.set_weights(model.get_weights()[:1])
    model.save_weights(tmp_path / "user.weights.h5")
    other = strategy.split(frozen_encoder())
    other.load_weights(tmp_path / "user.weights.h5")
    np.testing.assert_allclose(other.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)
    for a, b in zip(other.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def _devices(model):
    return [tf.DeviceSpec.from_string(v.value.device).device_index for v in model.weights]


def three_dense():
    return keras.Sequential(
        [
            keras.Input((8,)),
            *(keras.layers.Dense(8, activation="relu") for _ in range(2)),
            keras.layers.Dense(4),
        ]
    )


def functional_mlp():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8, activation="relu")(keras.layers.Dense(8, activation="relu")(inputs))
    return keras.Model(inputs, {"out": keras.layers.Dense(4)(keras.layers.LayerNormalization()(hidden))})


@pytest.mark.parametrize(
    ("build", "options"),
    [
        (three_dense, {"num_devices": 2}),
        pytest.param(three_dense, {"num_devices": 3}, marks=pytest.mark.slow),
        (three_dense, {"tensor_parallel": 2}),
        pytest.param(functional_mlp, {"num_devices": 2}, marks=pytest.mark.slow),
        (functional_mlp, {"tensor_parallel": 2}),
    ],
)
def test_a_split_model_saves_and_loads_on_its_devices_and_trains_on(tmp_path, build, options):
    x, y = _dense_data()
    if build is functional_mlp:
        y = {"out": y}
    split = ModelSplitStrategy(**options).split(build())
    _fit(split, x, y, "adam", epochs=1)
    split.save(tmp_path / "split.keras")
    loaded = keras.models.load_model(tmp_path / "split.keras")
    assert type(loaded) is type(split) and _devices(loaded) == _devices(split)
    assert len(set(_devices(loaded))) > 1
    for a, b in zip(*(keras.tree.flatten(m.predict(x, verbose=0)) for m in (loaded, split)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)
    # The optimizer state came back too: one more epoch is the same on both.
    more = [m.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"] for m in (split, loaded)]
    np.testing.assert_allclose(more[0], more[1], rtol=RTOL)


def test_a_data_parallel_split_model_saves_the_unsplit_model_which_trains_on(tmp_path):
    # Its D copies are not one Keras model: it saves what strategy.merge gives (it used to
    # refuse, after training, so a harness case could only crash).
    x, y = _dense_data()
    strategy = ModelSplitStrategy(num_devices=2, data_parallel=2)
    split = strategy.split(wide_mlp())
    _fit(split, x, y, "adam", epochs=1)
    split.save(tmp_path / "split.keras")
    loaded = keras.models.load_model(tmp_path / "split.keras")
    merged = strategy.merge(split)
    assert type(loaded) is type(merged) and loaded.compiled
    np.testing.assert_allclose(loaded.predict(x, verbose=0), split.predict(x, verbose=0), atol=1e-6)
    more = [m.fit(x, y, batch_size=8, shuffle=False, verbose=0).history["loss"] for m in (merged, loaded)]
    np.testing.assert_allclose(more[0], more[1], rtol=RTOL)


def masked_sequence_model():
    return keras.Sequential(
        [
            keras.Input((SEQ, 3)),
            keras.layers.Masking(0.0),
            keras.layers.LSTM(6, return_sequences=True),
            keras.layers.Dense(2),
        ]
    )


def _masked_sequences():
    x, _ = _tokens()
    features = np.repeat(x[..., None].astype("float32") / VOCAB, 3, axis=-1)
    return features, np.random.RandomState(1).randn(len(x), SEQ, 2).astype("float32")


def test_layer_split_data_parallel_averages_a_masked_loss_over_the_batch_valid_steps():
    options = {"num_devices": 2, "data_parallel": 2}
    assert_like_keras(masked_sequence_model, options, *_masked_sequences(), "sgd", metrics=["mae"])


def test_compat_clip_norm_by_groups_clips_a_group_by_its_joint_norm():
    """The gate of tfscale.compat.keras_optimizer_clip: Keras's private hooks still clip."""
    from tfscale.compat.keras_optimizer_clip import clip_norm_by_groups

    a, b, alone = (keras.Variable(np.zeros(2, "float32")) for _ in range(3))
    optimizer = keras.optimizers.SGD(1.0, clipnorm=1.0)
    clip_norm_by_groups(optimizer, lambda v: "ab" if v is a or v is b else None)
    grads = [
        np.array([3.0, 0.0], "float32"),
        np.array([0.0, 4.0], "float32"),
        np.array([6.0, 8.0], "float32"),
    ]
    optimizer.apply(grads, [a, b, alone])
    np.testing.assert_allclose(a.numpy(), [-0.6, 0.0], rtol=1e-6)  # the group's norm is 5
    np.testing.assert_allclose(b.numpy(), [0.0, -0.8], rtol=1e-6)
    np.testing.assert_allclose(alone.numpy(), [-0.6, -0.8], rtol=1e-6)  # its own norm, 10
