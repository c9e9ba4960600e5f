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

from tfscale.strategies import BalanceError, ModelSplitError, ModelSplitStrategy

RTOL, ATOL = 1e-5, 1e-5
VOCAB, SEQ = 16, 7


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


def assert_like_keras(build, options, x, y, optimizer, **fit_kwargs):
    """Trains `build()` in plain Keras and split by `options`; losses, weights and predictions agree."""
    keras.utils.set_random_seed(3)
    model = build()
    initial = model.get_weights()
    keras.utils.set_random_seed(3)
    twin = build()
    twin.set_weights(initial)
    strategy = ModelSplitStrategy(**options)
    split = strategy.split(twin)
    want = _fit(model, x, y, keras.optimizers.get(optimizer), **fit_kwargs)
    got = _fit(split, x, y, keras.optimizers.get(optimizer), **fit_kwargs)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=RTOL, err_msg=key)
    merged = strategy.merge(split)
    for a, b in zip(merged.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=ATOL)
    np.testing.assert_allclose(split.predict(x, verbose=0), model.predict(x, verbose=0), atol=ATOL)
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


@pytest.mark.parametrize("rnn", sorted(RNNS))
def test_layer_split_carries_the_embedding_mask_to_the_rnn(rnn):
    strategy, _, _ = assert_like_keras(
        embedding_lstm(RNNS[rnn]), {"num_devices": 2, "balance": [1, 2]}, *_tokens(), "adam"
    )
    assert [len(part["layers"]) for part in strategy.placement] == [1, 2]


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
