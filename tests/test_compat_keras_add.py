"""tfscale/compat/keras_add.py: Keras's TensorFlow `add` broadcasts a (batch, 1) term at any batch size.

Keras adds a tensor whose one non-1 dimension matches the other's channels with
`tf.nn.bias_add`, wherever that dimension is: a (batch, 1) per-row term added to a
(batch, C) activation goes along the channels when the batch has C rows. The shapes are
generated (every pair of ranks 1-4 with one non-1 dimension placed anywhere), and each is
checked against numpy's broadcasting, before the fix (Keras's own function, to see the
gate is still needed) and after it.
"""

import itertools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.compat import keras_add
from tfscale.strategies import PipelineStrategy

C = 4


def _keras_add():
    from keras.src.backend.tensorflow import numpy as tf_numpy

    keras_add.add_by_broadcasting()
    return tf_numpy.add.__wrapped__, tf_numpy.add  # Keras's own, and the wrapped one


def _shape_pairs():
    """(x1, x2) shapes: x1 of rank 2-4 with C at one axis, x2 with one dimension C or rows."""
    for rank in (2, 3, 4):
        for channel in (1, rank - 1):
            x1 = [C if k == channel else 3 for k in range(rank)]
            x1[0] = C  # the batch has as many rows as there are channels: the bad size
            for rank2 in range(1, rank + 1):
                for k in range(rank2):
                    x2 = [1] * rank2
                    x2[k] = C
                    yield tuple(x1), tuple(x2)


def _broadcasts(a, b):
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


ALL_PAIRS = sorted(set(_shape_pairs()))
PAIRS = [(a, b) for a, b in ALL_PAIRS if _broadcasts(a, b)]  # numpy gives them a meaning


@pytest.mark.parametrize(("x1", "x2"), PAIRS, ids=[f"{a}+{b}" for a, b in PAIRS])
def test_add_broadcasts_every_shape_pair_as_numpy_does(x1, x2):
    original, wrapped = _keras_add()
    rng = np.random.RandomState(0)
    a, b = rng.randn(*x1).astype("float32"), rng.randn(*x2).astype("float32")
    want = a + b
    misread = keras_add.misread_as_bias(list(x1), list(x2))
    np.testing.assert_allclose(wrapped(tf.constant(a), tf.constant(b)).numpy(), want, rtol=1e-6, atol=1e-6)
    # The gate's own claim, checked against Keras's function: it is wrong exactly where
    # `misread_as_bias` says so (or it raises where the bias shape does not fit).
    try:
        got = original(tf.constant(a), tf.constant(b)).numpy()
        right = got.shape == want.shape and np.allclose(got, want, rtol=1e-6, atol=1e-6)
    except (tf.errors.InvalidArgumentError, ValueError):
        right = False
    assert right != misread, f"Keras's add {'is' if right else 'is not'} right on {x1} + {x2}"


def test_the_gate_is_still_needed_a_batch_of_c_rows_plus_a_row_mean():
    original, _ = _keras_add()
    x = np.random.RandomState(1).randn(C, C).astype("float32")
    row_mean = x.mean(axis=-1, keepdims=True)
    # If this starts to fail, Keras fixed its `add`: set FIXED_IN and gate the wrapper on it.
    assert not np.allclose(original(tf.constant(x), tf.constant(row_mean)).numpy(), x + row_mean)
    assert keras_add.misread_as_bias([C, C], [C, 1]) and not keras_add.misread_as_bias([C, C], [1, C])
    assert not keras_add.misread_as_bias([8, C], [8, 1])  # squeezes to 8: no channel axis of size 8


def _mean_skip():
    x = keras.Input((8,))
    h = keras.layers.Dense(16, name="d1")(x)
    h = h + keras.ops.mean(x, axis=-1, keepdims=True)  # a (batch, 1) term added to (batch, 16)
    return keras.Model(x, keras.layers.Dense(4, name="out")(h))


def test_a_pipeline_whose_microbatches_have_as_many_rows_as_channels_equals_plain_keras():
    rng = np.random.RandomState(0)
    x, y = rng.randn(32, 8).astype("float32"), rng.randn(32, 4).astype("float32")
    keras.utils.set_random_seed(3)
    model = _mean_skip()
    twin = _mean_skip()
    twin.set_weights(model.get_weights())
    pipelined = PipelineStrategy(num_stages=2, num_microbatches=2, schedule="1f1b").split(twin)
    for m in (model, pipelined):
        m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    # Batches of 32: plain Keras adds on 32 rows, the pipeline on micro-batches of 16 = channels.
    want = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0).history["loss"]
    got = pipelined.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        pipelined.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-5, atol=1e-5
    )


def test_shapes_that_do_not_broadcast_keep_keras_behaviour():
    # (N, C, H) + (C,): Keras adds along axis 1 (NCHW), numpy refuses; left as Keras has it.
    assert [keras_add.misread_as_bias(list(a), list(b)) for a, b in ALL_PAIRS if (a, b) not in PAIRS] == [
        False
    ] * (len(ALL_PAIRS) - len(PAIRS))


def test_the_shape_pairs_cover_both_formats_and_every_position():
    assert len(PAIRS) >= 15
    assert any(keras_add.misread_as_bias(list(a), list(b)) for a, b in PAIRS)
    assert any(not keras_add.misread_as_bias(list(a), list(b)) for a, b in PAIRS)
    assert all(_broadcasts(a, b) for a, b in PAIRS)
    assert {len(a) for a, _ in PAIRS} == {2, 3, 4} and set(itertools.chain(*(b for _, b in PAIRS))) == {1, C}
