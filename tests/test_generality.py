"""The Keras models people write, through every pipeline schedule and model split mode.

Each model (tiny, in the styles of public Keras examples: Sequential, functional, custom
layers without `build()` or `**kwargs`, Dropout, BatchNorm, Embedding, LSTM, convolutions,
a softmax head) is trained for 2 steps unsplit and by each mode, from the same weights and
seed states, and must give the same losses (relative 1e-5) and final weights (absolute
2e-5, through `merge`). Dropout draws and BatchNorm statistics are per micro-batch in a
pipeline, so models that have them are pipelined with one micro-batch (which checks that
the stage copies carry the seed states); the others with two.

`pytest tests/test_generality.py -s` prints the measured differences (README table).
"""

import _model_helpers as helpers
import keras
import numpy as np
import pytest

from tfscale import strategies

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_model_trains_like_the_unsplit_model": 4,
}


LOSS_RTOL, WEIGHT_ATOL, STEPS, BATCH = 1e-5, 2e-5, 2, 8
MODES = ("gpipe", "1f1b", "layer", "tensor")


class TokenAndPositionEmbedding(keras.layers.Layer):
    """As in the Keras text-classification-with-Transformer example: no get_config,
    no **kwargs, sub-layers made in __init__, no build()."""

    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = keras.layers.Embedding(vocab_size, embed_dim)
        self.pos_emb = keras.layers.Embedding(maxlen, embed_dim)

    def call(self, x):
        positions = keras.ops.arange(0, keras.ops.shape(x)[-1], 1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(keras.layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1):
        super().__init__()
        self.att = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential(
            [keras.layers.Dense(ff_dim, activation="relu"), keras.layers.Dense(embed_dim)]
        )
        self.layernorm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = keras.layers.Dropout(rate)
        self.dropout2 = keras.layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.dropout1(self.att(inputs, inputs), training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.dropout2(self.ffn(out1), training=training)
        return self.layernorm2(out1 + ffn_output)


class ResidualBlock(keras.layers.Layer):
    """The README's advice for branches: the whole residual block is one Layer."""

    def __init__(self, filters, **kwargs):
        super().__init__(**kwargs)
        self.filters = filters
        self.conv1 = keras.layers.Conv2D(filters, 3, padding="same", activation="relu")
        self.conv2 = keras.layers.Conv2D(filters, 3, padding="same")
        self.norm = keras.layers.BatchNormalization()

    def call(self, x, training=None):
        y = self.norm(self.conv2(self.conv1(x)), training=training)
        return keras.ops.relu(x + y)

    def get_config(self):
        return {**super().get_config(), "filters": self.filters}


def convnet_dropout():
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(4, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Dropout(0.25),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dropout(0.5),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def transformer_classifier():
    inputs = keras.Input((6,), dtype="int32")
    x = TokenAndPositionEmbedding(6, 32, 8)(inputs)
    x = TransformerBlock(8, 2, 8)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dropout(0.1)(x)
    x = keras.layers.Dense(8, activation="relu")(x)
    outputs = keras.layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs, outputs)


def conv1d_batchnorm():
    return keras.Sequential(
        [
            keras.Input((12, 2)),
            keras.layers.Conv1D(4, 3),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def bidirectional_lstm():
    return keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(32, 8),
            keras.layers.Bidirectional(keras.layers.LSTM(4)),
            keras.layers.Dense(2, activation="softmax"),
        ]
    )


def residual_convnet():
    return keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, padding="same"),
            ResidualBlock(4),
            ResidualBlock(4),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(3, activation="softmax"),
        ]
    )


def softmax_mlp():
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(4, activation="softmax"),
        ]
    )


# name -> (builder, input kind, classes (0: regression), has Dropout/BatchNorm)
MODELS = {
    "convnet_dropout": (convnet_dropout, (8, 8, 1), 3, True),
    "transformer_classifier": (transformer_classifier, "ids", 2, True),
    "conv1d_batchnorm": (conv1d_batchnorm, (12, 2), 0, True),
    "bidirectional_lstm": (bidirectional_lstm, "ids", 2, False),
    "residual_convnet": (residual_convnet, (6, 6, 2), 3, True),
    "softmax_mlp": (softmax_mlp, (6,), 4, False),
}


def data(name):
    _, kind, classes, _ = MODELS[name]
    rng = np.random.RandomState(0)
    n = BATCH * STEPS
    x = rng.randint(0, 32, (n, 6)).astype("int32") if kind == "ids" else rng.randn(n, *kind).astype("float32")
    y = rng.randint(0, classes, (n,)) if classes else rng.randn(n, 1).astype("float32")
    return x, y


def fresh(name):
    return helpers.seeded(MODELS[name][0], 3)


def train(model, name):
    loss = "sparse_categorical_crossentropy" if MODELS[name][2] else "mse"
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss=loss)
    x, y = data(name)
    return model.fit(x, y, batch_size=BATCH, epochs=STEPS, shuffle=False, verbose=0).history["loss"]


@pytest.fixture(scope="module")
def reference():
    """Per model: per-step losses and final weights of the unsplit run."""

    def run(name):
        model = fresh(name)
        return train(model, name), model.get_weights()

    return helpers.once_per_key(run)


# (model, mode) -> the one-line refusal expected (layer named, reason given).
REFUSED = {
    ("residual_convnet", "tensor"): r"^Model '\w+' has no layer to tensor-split 2 ways: .*\('dense_\d+': its "
    r"`units` is 3, not divisible by 2\)\.$",
}


def split(name, mode):
    """(strategy, split model) for `mode`, from a fresh copy of the user's model."""
    model = fresh(name)
    if mode in ("gpipe", "1f1b"):
        m = 1 if MODELS[name][3] else 2
        strategy = strategies.get("pipeline", num_stages=2, num_microbatches=m, schedule=mode)
    elif mode == "layer":
        strategy = strategies.get("model_split", num_devices=2)
    else:
        strategy = strategies.get("model_split", tensor_parallel=2)
    return strategy, strategy.split(model)


# The transformer (the slowest model, 20-36 s a mode under load) keeps one mode in the fast tier.
@pytest.mark.parametrize(
    ("name", "mode"),
    [
        pytest.param(
            name,
            mode,
            id=f"{name}-{mode}",
            marks=pytest.mark.slow if name == "transformer_classifier" and mode != "gpipe" else (),
        )
        for name in MODELS
        for mode in MODES
    ],
)
def test_model_trains_like_the_unsplit_model(reference, name, mode):
    if (name, mode) in REFUSED:
        with pytest.raises(ValueError, match=REFUSED[name, mode]) as refusal:
            split(name, mode)
        assert "\n" not in str(refusal.value)
        return
    losses, weights = reference(name)
    strategy, model = split(name, mode)
    got = train(model, name)
    merged = strategy.merge(model).get_weights()
    loss_diff = float(np.max(np.abs(np.subtract(got, losses))))
    weight_diff = max(float(np.max(np.abs(a - b))) for a, b in zip(merged, weights))
    print(f"\nGENERALITY {name} {mode}: loss {loss_diff:.1e} weights {weight_diff:.1e}")
    np.testing.assert_allclose(got, losses, rtol=LOSS_RTOL)
    assert len(merged) == len(weights)
    for a, b in zip(merged, weights):
        np.testing.assert_allclose(a, b, atol=WEIGHT_ATOL)
