"""ModelSplitStrategy and the tensor-split layers, checked against the unsplit model on one device.

Tolerance: float32 round-off. A split changes only the order of additions (row-split sums,
per-head attention sums), so per-epoch losses must agree to a relative 1e-5 and final weights
to an absolute 2e-5 after 3 epochs of SGD with momentum.
"""

import _model_helpers as helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import strategies
from tfscale.strategies import (
    BalanceError,
    ColumnParallelDense,
    HeadParallelMultiHeadAttention,
    ModelSplitError,
    ModelSplitStrategy,
    RowParallelDense,
    StrategyError,
    VocabParallelEmbedding,
)

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_split_trains_like_the_unsplit_model": 2,
}


LOSS_RTOL, WEIGHT_ATOL = 1e-5, 2e-5
EPOCHS, SEQ, VOCAB, WIDTH = 3, 6, 32, 16
DEVICES = [f"/device:CPU:{i}" for i in range(4)]
SPLIT_TYPES = (ColumnParallelDense, RowParallelDense, VocabParallelEmbedding, HeadParallelMultiHeadAttention)


@keras.saving.register_keras_serializable(package="tfscale_tests")
class EncoderBlock(keras.layers.Layer):
    """A post-norm Transformer encoder block, one Layer so a model of blocks is a chain."""

    def __init__(self, heads=4, ff=32, **kwargs):
        super().__init__(**kwargs)
        self.heads, self.ff = heads, ff
        self.attention = keras.layers.MultiHeadAttention(heads, WIDTH // heads)
        self.up, self.down = keras.layers.Dense(ff, activation="relu"), keras.layers.Dense(WIDTH)
        self.norm1, self.norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()

    def build(self, shape):
        self.attention.build(shape, shape)
        for layer in (self.norm1, self.up, self.norm2):
            layer.build(shape)
        self.down.build((*shape[:-1], self.ff))

    def call(self, x):
        x = self.norm1(x + self.attention(x, x))
        return self.norm2(x + self.down(self.up(x)))

    def get_config(self):
        return {**super().get_config(), "heads": self.heads, "ff": self.ff}


def mlp():
    layers = [keras.layers.Dense(w, activation="relu") for w in (32, 32, 16)] + [keras.layers.Dense(8)]
    return keras.Sequential([keras.Input((16,)), *layers], name="mlp")


def encoder_chain():
    """Transformer encoder as a chain of blocks (what layer split cuts)."""
    return keras.Sequential(
        [
            keras.Input((SEQ,), dtype="int32"),
            keras.layers.Embedding(VOCAB, WIDTH),
            EncoderBlock(name="block_0"),
            EncoderBlock(name="block_1"),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(4),
        ],
        name="encoder_chain",
    )


def encoder_graph():
    """The same encoder written flat (what tensor split rewrites: Embedding, MHA, Dense)."""
    ids = keras.Input((SEQ,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, WIDTH, name="embed")(ids)
    for i in range(2):
        attended = keras.layers.MultiHeadAttention(4, WIDTH // 4, name=f"attn_{i}")(x, x)
        x = keras.layers.LayerNormalization(name=f"norm_{i}a")(x + attended)
        up = keras.layers.Dense(32, activation="relu", name=f"up_{i}")(x)
        x = keras.layers.LayerNormalization(name=f"norm_{i}b")(
            x + keras.layers.Dense(WIDTH, name=f"down_{i}")(up)
        )
    out = keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(x))
    return keras.Model(ids, out, name="encoder_graph")


MODELS = {"mlp": mlp, "encoder_chain": encoder_chain, "encoder_graph": encoder_graph}


def data(name):
    rng = np.random.RandomState(0)
    if name == "mlp":
        return rng.randn(64, 16).astype("float32"), rng.randn(64, 8).astype("float32")
    return rng.randint(0, VOCAB, (64, SEQ)).astype("int32"), rng.randint(0, 4, (64,)).astype("int32")


def fresh(name):
    return helpers.seeded(MODELS[name], 7)


def train(model, name):
    loss = "mse" if name == "mlp" else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
    x, y = data(name)
    return model.fit(x, y, batch_size=16, epochs=EPOCHS, shuffle=False, verbose=0).history["loss"]


@pytest.fixture(scope="module")
def reference():
    """Per model: initial weights, per-epoch losses and final weights of the unsplit run."""

    def run(name):
        model = fresh(name)
        initial = [w.copy() for w in model.get_weights()]
        return initial, train(model, name), model.get_weights()

    return helpers.once_per_key(run)


def device_name(variable):
    spec = tf.DeviceSpec.from_string(variable.value.device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def variable_bytes(variables):
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("mlp", {"num_devices": 2}),
        ("mlp", {"num_devices": 4}),
        ("mlp", {"tensor_parallel": 2}),
        ("mlp", {"tensor_parallel": 4}),
        ("encoder_chain", {"num_devices": 2}),
        ("encoder_chain", {"num_devices": 4}),
        ("encoder_graph", {"tensor_parallel": 2}),
        ("encoder_graph", {"tensor_parallel": 4}),
    ],
)
def test_split_trains_like_the_unsplit_model(reference, name, options):
    initial, ref_losses, ref_weights = reference(name)
    model = fresh(name)
    model.set_weights(initial)
    strategy = strategies.get("model_split", **options)
    split = strategy.split(model)
    losses = train(split, name)
    np.testing.assert_allclose(losses, ref_losses, rtol=LOSS_RTOL)
    for got, want in zip(strategy.merge(split).get_weights(), ref_weights, strict=True):
        np.testing.assert_allclose(got, want, atol=WEIGHT_ATOL)
    # Each SGD momentum slot lives with its variable (Keras would put them all on CPU:0).
    slots = split.optimizer.momentums
    assert [device_name(s) for s in slots] == [device_name(v) for v in split.trainable_variables]
    assert len({device_name(v) for v in split.trainable_variables}) == strategy.num_devices


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "encoder_graph"])
def test_tensor_split_holds_one_kth_of_the_split_layers_per_device(name, k):
    model = fresh(name)
    original = variable_bytes(
        v
        for layer in model.layers
        if isinstance(layer, strategies.model_split.tensor_split.SUPPORTED)
        for v in layer.weights
    )
    strategy = ModelSplitStrategy(tensor_parallel=k)
    split = strategy.split(model)
    per_device = {}
    for layer in split.layers:
        if isinstance(layer, SPLIT_TYPES):
            for v in layer.weights:
                per_device[device_name(v)] = per_device.get(device_name(v), 0) + variable_bytes([v])
    assert sorted(per_device) == DEVICES[:k]
    for got in per_device.values():
        assert abs(got - original / k) <= 0.01 * original / k
    report = {row["device"]: row for row in strategy.report(split)}
    assert sum(row["param_bytes"] for row in report.values()) == 4 * model.count_params()


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "encoder_chain"])
def test_layer_split_places_each_part_on_its_device(name, k):
    model = fresh(name)
    strategy = ModelSplitStrategy(num_devices=k)
    split = strategy.split(model)
    per_device = {}
    for layer in split.layers:
        devices = {device_name(v) for v in layer.weights}
        assert len(devices) <= 1, f"layer {layer.name} spans {devices}"
        for v in layer.weights:
            per_device[device_name(v)] = per_device.get(device_name(v), 0) + variable_bytes([v])
    planned = {part["device"]: part["param_bytes"] for part in strategy.placement}
    assert per_device == {d: b for d, b in planned.items() if b}
    # The balancer's stated tolerance: no part above total / K + the largest layer.
    largest = max(variable_bytes(layer.weights) for layer in model.layers)
    assert max(per_device.values()) <= 4 * model.count_params() / k + largest
    assert [row["param_bytes"] for row in strategy.report(split)] == [
        p["param_bytes"] for p in strategy.placement
    ]


def test_layer_split_weights_file_loads_into_the_original_and_back(tmp_path):
    model = fresh("mlp")
    split = ModelSplitStrategy(num_devices=2).split(model)
    train(split, "mlp")
    split.save_weights(tmp_path / "split.weights.h5")
    original = fresh("mlp")
    original.load_weights(tmp_path / "split.weights.h5")
    for got, want in zip(original.get_weights(), split.get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)
    devices = [device_name(v) for v in split.weights]
    original.save_weights(tmp_path / "original.weights.h5")
    fresh_split = ModelSplitStrategy(num_devices=2).split(fresh("mlp"))
    fresh_split.load_weights(tmp_path / "original.weights.h5")
    assert [device_name(v) for v in fresh_split.weights] == devices
    x, _ = data("mlp")
    np.testing.assert_allclose(fresh_split.predict(x, verbose=0), original.predict(x, verbose=0), atol=1e-6)


def test_tensor_split_weights_go_through_merge_into_the_original(tmp_path):
    strategy = ModelSplitStrategy(tensor_parallel=2)
    split = strategy.split(fresh("encoder_graph"))
    train(split, "encoder_graph")
    strategy.merge(split).save_weights(tmp_path / "merged.weights.h5")
    original = fresh("encoder_graph")
    original.load_weights(tmp_path / "merged.weights.h5")
    x, y = data("encoder_graph")
    np.testing.assert_allclose(original.predict(x, verbose=0), split.predict(x, verbose=0), atol=1e-5)
    resplit = strategy.split(original)
    resplit.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    split.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert resplit.evaluate(x, y, verbose=0) == pytest.approx(split.evaluate(x, y, verbose=0), rel=1e-6)


def test_layers_alone_match_their_keras_counterparts():
    rng = np.random.RandomState(1)
    x = rng.randn(3, 5, 8).astype("float32")
    ids = rng.randint(1, 12, (3, 5))
    ids[0, :2] = 0
    mha, dense, embed = (
        keras.layers.MultiHeadAttention(4, 6),
        keras.layers.Dense(8),
        keras.layers.Embedding(12, 8),
    )
    dense(x), embed(ids), mha(x, x)
    pairs = [
        (ColumnParallelDense(8, DEVICES[:2]), dense, (x,), {}),
        (RowParallelDense(8, DEVICES[:4]), dense, (x,), {}),
        (VocabParallelEmbedding(12, 8, DEVICES[:4]), embed, (ids,), {}),
        (HeadParallelMultiHeadAttention(4, 6, DEVICES[:2]), mha, (x, x), {}),
        (HeadParallelMultiHeadAttention(4, 6, DEVICES[:4]), mha, (x, x), {"use_causal_mask": True}),
    ]
    for split, whole, args, kwargs in pairs:
        split(*args, **kwargs)
        split.set_full_weights(whole.get_weights())
        np.testing.assert_allclose(split(*args, **kwargs), whole(*args, **kwargs), atol=1e-6)
        for got, want in zip(split.full_weights(), whole.get_weights(), strict=True):
            np.testing.assert_array_equal(got, want)


def test_megatron_pair_passes_shards_without_gathering():
    up = ColumnParallelDense(16, DEVICES[:2], activation="relu", gather_output=False)
    down = RowParallelDense(8, DEVICES[:2], input_is_parallel=True)
    shards = up(np.ones((2, 4), "float32"))
    assert [device_name_of_tensor(s) for s in shards] == DEVICES[:2]
    assert down(shards).shape == (2, 8)


def device_name_of_tensor(tensor):
    spec = tf.DeviceSpec.from_string(tensor.device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def test_get_returns_the_strategy_with_its_devices():
    strategy = strategies.get("model_split", devices=["/cpu:1", "/device:CPU:3"], balance="uniform")
    assert isinstance(strategy, ModelSplitStrategy)
    assert strategy.devices == ["/device:CPU:1", "/device:CPU:3"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"num_devices": 8}, r"num_devices=8, more than the 4 logical CPU"),
        ({"devices": ["/device:CPU:0", "/device:CPU:9"]}, r"`devices`.*CPU:9"),
        ({"devices": ["/cpu:0", "/cpu:0"]}, r"Expected distinct devices"),
        ({"num_devices": 2, "tensor_parallel": 3}, r"tensor_parallel=3 with 2 device"),
        ({"num_devices": 2, "balance": "flops"}, r"balance='flops'"),
        ({"num_devices": 2, "tensor_layers": ["x"]}, r"`tensor_layers=\['x'\]` needs tensor split"),
        (
            {"num_devices": 2, "foo": 1},
            r"Unknown option\(s\) \['foo'\].*'model_split'.*'balance'",
        ),
    ],
)
def test_bad_options_are_refused(options, message):
    tf.config.list_logical_devices()  # Started: the 4 devices of conftest can no longer grow.
    with pytest.raises(StrategyError, match=message):
        strategies.get("model_split", **options)


def odd_mlp():
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(30, name="odd"), keras.layers.Dense(8)])


@pytest.mark.parametrize(
    ("build", "options", "error", "message"),
    [
        (
            odd_mlp,
            {"tensor_parallel": 4, "tensor_layers": ["odd"]},
            ModelSplitError,
            r"layer 'odd' \(Dense\) 4 ways: its `units` is 30, not divisible by 4\. Expected it left out",
        ),
        (
            encoder_graph,
            {"tensor_parallel": 2, "tensor_layers": ["norm_0a"]},
            ModelSplitError,
            r"layer 'norm_0a': its type LayerNormalization has no split form",
        ),
        (
            encoder_graph,
            {"tensor_parallel": 2, "tensor_layers": ["nope"]},
            ModelSplitError,
            r"no layer 'nope'",
        ),
        (
            encoder_graph,
            {"num_devices": 2, "balance": "time"},
            BalanceError,
            r"balance='time' for model 'encoder_graph'",
        ),
        (mlp, {"num_devices": 4, "balance": [1, 1, 1]}, BalanceError, r"Expected 4 positive layer counts"),
    ],
)
def test_models_that_cannot_be_split_are_refused_naming_the_layer(build, options, error, message):
    with pytest.raises(error, match=message):
        ModelSplitStrategy(**options).split(build())


def test_too_few_layers_for_the_devices_is_refused():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(2)])
    with pytest.raises(BalanceError, match=r"too few layers to make 4 parts \(layers: 2, parts: 4\)"):
        ModelSplitStrategy(num_devices=4).split(model)


def test_split_layer_options_without_split_form_are_refused():
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, kernel_regularizer="l2", name="reg")])
    with pytest.raises(ModelSplitError, match=r"layer 'reg' \(Dense\) 2 ways: option `kernel_regularizer="):
        ModelSplitStrategy(tensor_parallel=2, tensor_layers=["reg"]).split(model)
    with pytest.raises(ModelSplitError, match=r"no layer to tensor-split 2 ways.*'reg': option `kernel_reg"):
        ModelSplitStrategy(tensor_parallel=2).split(model)


def test_unbuilt_model_and_foreign_merge_are_refused():
    strategy = ModelSplitStrategy(tensor_parallel=2)
    with pytest.raises(ModelSplitError, match=r"'lazy': it is not built"):
        strategy.split(keras.Sequential([keras.layers.Dense(4)], name="lazy"))
    with pytest.raises(ModelSplitError, match=r"`split_model`.*'mlp' was not returned"):
        strategy.merge(mlp())


@pytest.mark.parametrize(("options", "per_device"), [({"num_devices": 4}, 1), ({"tensor_parallel": 4}, 4)])
def test_matmuls_are_placed_on_every_device(options, per_device):
    """The traced graph asks each device to multiply by its own weights (forward and backward)."""
    split = ModelSplitStrategy(**options).split(fresh("mlp"))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(split(x))
        return tape.gradient(loss, split.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((None, 16), tf.float32)).graph
    placed = [device_name_of_tensor(op) for op in graph.get_operations() if op.type == "MatMul"]
    counts = {device: placed.count(device) for device in set(placed)}
    # Per layer (and per shard): 1 forward and 2 backward products, none left unplaced.
    assert counts == {device: 3 * per_device for device in DEVICES}


def test_functional_chain_with_dropout_splits_by_time_and_keeps_adam_slots_with_weights(tmp_path):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dropout(0.5)(keras.layers.Dense(8, name="a")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(4, name="b")(keras.layers.ReLU()(hidden)))
    x = np.random.RandomState(2).randn(4, 8).astype("float32")
    strategy = ModelSplitStrategy(num_devices=2, balance="time", sample_input=x)
    split = strategy.split(model)
    assert sum(len(part["layers"]) for part in strategy.placement) == 4
    np.testing.assert_allclose(split(x, training=False), model(x), atol=1e-6)
    assert not np.allclose(split(x, training=True), model(x))  # `training` reaches Dropout.
    split.compile(optimizer="adam", loss="mse")
    split.optimizer.build(split.trainable_variables)
    slots = [v for v in split.optimizer.variables if v.name not in ("iteration", "learning_rate")]
    want = sorted(device_name(v) for v in split.trainable_variables for _ in ("momentum", "velocity"))
    assert sorted(device_name(v) for v in slots) == want
    split.save_weights(tmp_path / "chain.weights.h5")
    copy = keras.models.clone_model(model)
    copy.load_weights(tmp_path / "chain.weights.h5")
    np.testing.assert_allclose(copy(x), model(x), atol=1e-6)


@pytest.mark.parametrize("method", ["parameters", "time"])
@pytest.mark.parametrize("where", ["constructor", "split"])
def test_balance_reaches_the_partitioner(method, where, monkeypatch):
    model, x = helpers.uneven_mlp(), np.zeros((4, 7), "float32")
    layers = strategies._partition.chain_layers(model)
    times = [1.0, 1.0, 1.0, 1.0, 9.0]  # "time": the last layer alone on one device.
    if method == "time":
        helpers.fix_layer_times(monkeypatch, times)
    expected = strategies._partition.balance(layers, 2, method, x)
    assert expected not in ([3, 2], [2, 3])  # unlike "uniform"
    if method == "time":
        helpers.fix_layer_times(monkeypatch, times)
    if where == "constructor":
        strategy = ModelSplitStrategy(num_devices=2, balance=method, sample_input=x)
        strategy.split(model)
    else:  # Where the pipeline takes it.
        strategy = ModelSplitStrategy(num_devices=2, balance=method)
        strategy.split(model, sample_input=x)
    assert [len(part["layers"]) for part in strategy.placement] == expected


def centred(x):
    """A custom activation that mixes the units (not elementwise)."""
    return x - keras.ops.mean(x, axis=-1, keepdims=True)


def softmax_classifier():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation=centred, name="mixer"),
            keras.layers.Dense(4, activation="softmax", name="probs"),
            keras.layers.Dense(1, name="score"),
        ],
        name="classifier",
    )


def test_tensor_split_of_a_softmax_classifier_is_exact_and_reported():
    keras.utils.set_random_seed(5)
    model = softmax_classifier()
    x = np.random.RandomState(0).randn(8, 6).astype("float32")
    strategy = ModelSplitStrategy(tensor_parallel=2)
    split = strategy.split(model)
    np.testing.assert_allclose(split(x), model(x), atol=1e-6)
    probs = keras.Model(split.inputs, split.get_layer("probs").output)(x)
    np.testing.assert_allclose(np.sum(probs, axis=-1), 1.0, atol=1e-6)
    first, second = strategy.report(split)
    assert first["split_layers"] == second["split_layers"] == ["mixer", "probs"]
    assert first["whole_layers"] == {"score": "its `units` is 1, not divisible by 2"}
    assert second["whole_layers"] == {}
    np.testing.assert_allclose(strategy.merge(split)(x), model(x), atol=1e-6)


@pytest.mark.parametrize("activation", ["softmax", "log_softmax", centred])
def test_column_layer_gathers_before_an_activation_that_mixes_units(activation):
    x = np.random.RandomState(1).randn(4, 6).astype("float32")
    dense = keras.layers.Dense(4, activation=activation)
    dense.build((None, 6))
    column = ColumnParallelDense(4, DEVICES[:2], activation=activation)
    column.build((None, 6))
    column.set_full_weights(dense.get_weights())
    np.testing.assert_allclose(column(x), dense(x), atol=1e-6)
    with pytest.raises(ModelSplitError, match=r"without gathering: its activation '\w+' is not elementwise"):
        ColumnParallelDense(4, DEVICES[:2], activation=activation, gather_output=False)


class NoKwargs(keras.layers.Layer):
    """The common custom-layer style: no **kwargs, sub-layers made in __init__, no build()."""

    def __init__(self, units, rate):
        super().__init__()
        self.dense = keras.layers.Dense(units, activation="relu")
        self.dropout = keras.layers.Dropout(rate)

    def call(self, x, training=None):
        return self.dropout(self.dense(x), training=training)


def test_layer_split_of_custom_layers_with_dropout_is_bitwise_the_users_model():
    keras.utils.set_random_seed(9)
    build = lambda: keras.Sequential(  # noqa: E731 -- the same model twice
        [
            keras.Input((8,)),
            NoKwargs(16, 0.5),
            keras.layers.Dropout(0.3),
            NoKwargs(8, 0.5),
            keras.layers.Dense(2),
        ]
    )
    model = build()
    split = ModelSplitStrategy(num_devices=2).split(model)
    x, y = data("mlp")[0][:32, :8], data("mlp")[1][:32, :2]
    for m in (model, split):
        m.compile(optimizer="sgd", loss="mse")
    expected = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"]
    assert split.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0).history["loss"] == expected


class TakesALayer(keras.layers.Layer):
    """A layer whose config cannot rebuild it: `inner` is an object it never serialises."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x):
        return self.inner(x)

    def get_config(self):
        return super().get_config()


def test_a_layer_that_cannot_be_copied_is_named_with_the_fix():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), TakesALayer(keras.layers.Dense(2), name="odd")]
    )
    with pytest.raises(
        StrategyError, match=r"^Cannot copy layer 'odd' \(TakesALayer\): .*Expected get_config\(\)"
    ) as e:
        ModelSplitStrategy(num_devices=2).split(model)
    assert "\n" not in str(e.value)
