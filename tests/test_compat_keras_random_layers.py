"""tfscale.compat.keras_random_layers: Dropout under `mirrored` draws one device's masks.

Each model trains under `get("mirrored", cpu_replicas=N)` (N = 2, 3) and is compared with
plain Keras on one device (same seed, data, order): the per-epoch logged losses, every
weight, `evaluate` and `predict`, to 1e-5 absolute plus 1e-5 relative. 19 samples in
batches of 8: the last batch splits 2 + 1 over 2 replicas, 1 + 1 + 1 over 3, and 8 splits
3 + 3 + 2. The models: every random layer Keras has (Dropout with and without
`noise_shape`, SpatialDropout1D, GaussianNoise, GaussianDropout, AlphaDropout), the
dropout and recurrent dropout of an LSTM cell (the RNN cells' one mask method), and image
augmentation layers beside a user's layer drawing `keras.random.normal` from its own
SeedGenerator (wrapped on first call: `draws_from_own_generators`); also 2 workers x 2
replicas. MixUp, which mixes rows, is refused in one line.
`test_stock_keras_differs` keeps them honest: without the fix each is off by more than
1e-3. One replica and `replica_random=True` launch nothing and draw as Keras does.
"""

import functools
from unittest import mock

import _model_helpers as helpers
import keras
import numpy as np
import pytest
import tensorflow as tf
from _compat_gate import version_gate_test

import tfscale.compat
from tfscale.compat import keras_random_layers
from tfscale.strategies import StrategyError, get

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_mirrored_matches_one_device": 1,
    "test_stock_keras_differs": 1,
}

BATCH, EPOCHS, SAMPLES = 8, 2, 19
TOLERANCE = 1e-5  # absolute, and relative: the replicas' partial sums are added in another order
MODELS = ("layers", "recurrent", "augment")


class _Jitter(keras.layers.Layer):
    """A user's random layer: normal noise from a SeedGenerator of its own, in training."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise = keras.random.SeedGenerator(5)

    def call(self, x, training=False):
        return x + 0.3 * keras.random.normal(keras.ops.shape(x), seed=self.noise) if training else x


def _model(name):
    L = keras.layers
    if name == "augment":
        hidden = [L.RandomFlip(), L.RandomTranslation(0.2, 0.2), L.RandomRotation(0.1), L.RandomZoom(0.2),
                  L.RandomContrast(0.3), _Jitter(), L.Flatten(), L.Dense(8)]  # fmt: skip
        # No Conv2D: 2 workers x 2 replicas leave one replica an empty last slice, and
        # oneDNN's Conv2DBackpropFilter fails on an empty batch ("Missing 1-th output";
        # TF 2.21 on CPU, with TF_ENABLE_ONEDNN_OPTS=1, its default).
        inputs = keras.Input((6, 6, 1))
    elif name == "layers":
        hidden = [L.Dense(8), L.Dropout(0.4, seed=3), L.Dropout(0.3, noise_shape=(None, 1, 8)),
                  L.SpatialDropout1D(0.3), L.GaussianNoise(0.3), L.GaussianDropout(0.3),
                  L.AlphaDropout(0.2), L.Flatten()]  # fmt: skip
    else:
        # GRU, SimpleRNN and ConvLSTM cells draw their masks through the same mixin method.
        hidden = [L.LSTM(4, dropout=0.3, recurrent_dropout=0.3)]
    if name != "augment":
        inputs = keras.Input((5, 3))
    model = keras.Sequential([inputs, *hidden, L.Dense(2)])
    model.compile(
        keras.optimizers.Adam(0.05),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data(samples, seed, name="layers"):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 6, 6, 1) if name == "augment" else (samples, 5, 3)).astype("float32")
    return x, rng.integers(0, 2, samples).astype("int32")


def _train(strategy, name):
    """{what: values} of the model `name` trained under `strategy`."""
    x, y = _data(SAMPLES, 1, name)
    xv, yv = _data(BATCH, 2, name)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _model(name)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    return {
        **{f"history.{k}": np.asarray(v) for k, v in history.items()},
        "weights": model.get_weights(),
        "evaluate": np.asarray(model.evaluate(xv, yv, batch_size=BATCH, verbose=0)),
        "predict": model.predict(xv, batch_size=BATCH, verbose=0),
    }


@functools.cache
def _reference(name):
    return _train(tf.distribute.get_strategy(), name)


def _list(value):
    return value if isinstance(value, list) else [value]


def _largest_difference(got, want):
    return max(
        float(np.max(np.abs(np.subtract(g, w))))
        for key in want
        for g, w in zip(_list(got[key]), _list(want[key]))
    )


def _assert_equal(got, want, tolerance=TOLERANCE):
    assert set(got) == set(want)
    for key in want:
        assert len(_list(got[key])) == len(_list(want[key])), key
        for i, (g, w) in enumerate(zip(_list(got[key]), _list(want[key]))):
            np.testing.assert_allclose(g, w, rtol=tolerance, atol=tolerance, err_msg=f"{key}[{i}]")


@pytest.mark.parametrize(
    ("name", "replicas"), [("layers", 3), ("recurrent", 3), ("augment", 3), ("layers", 2)]
)
def test_mirrored_matches_one_device(name, replicas):
    strategy = get("mirrored", cpu_replicas=replicas)
    assert keras_random_layers.is_applied()
    _assert_equal(_train(strategy, name), _reference(name))


def _train_stock(name, replicas=3):
    strategy = get("mirrored", cpu_replicas=replicas)  # Applies the fix; undone for this run.
    keras_random_layers._unapply()
    try:
        return _train(strategy, name)
    finally:
        keras_random_layers.apply()


@pytest.mark.parametrize("name", MODELS)
def test_stock_keras_differs(name):
    """Keras's per-replica draws: the same model, the fix undone, is off by >1e-3."""
    assert _largest_difference(_train_stock(name), _reference(name)) > 1e-3


def multi_worker_runs(names):
    """In each task of a cluster: the models `names` under `get("multi_worker", cpu_replicas=2)`."""
    strategy = get("multi_worker", cpu_replicas=2)
    runs = {name: _train(strategy, name) for name in names}
    return {"replicas": strategy.num_replicas_in_sync, "runs": runs}


@pytest.mark.slow
def test_multi_worker_matches_one_device():
    """2 workers x 2 replicas: the row counts are summed across the workers too."""
    from tfscale.launch import run_local_cluster

    results = run_local_cluster(
        multi_worker_runs, 2, args=(MODELS,), timeout=400, env={"TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    for result in results:
        assert result.value["replicas"] == 4
        for name in MODELS:
            _assert_equal(result.value["runs"][name], _reference(name))


def _launches():
    """A mock counting the fix's all-reduces as they are traced (and still making them)."""
    return mock.patch.object(
        keras_random_layers, "_offset_and_total", wraps=keras_random_layers._offset_and_total
    )


@pytest.mark.slow  # 16 s, four runs; fast tier: test_mirrored_matches_one_device and the stock run
def test_one_replica_and_replica_random_launch_nothing_and_draw_as_keras():
    with _launches() as launched:
        alone = _train(get("mirrored", cpu_replicas=1), "layers")
        kept = _train(get("mirrored", cpu_replicas=3, replica_random=True), "layers")
    assert launched.call_count == 0
    _assert_equal(alone, _reference("layers"))  # one replica is one device
    stock = _train_stock("layers")
    _assert_equal(kept, stock, tolerance=0)  # Keras's own per-replica draws, as asked
    with _launches() as launched:
        _train(get("mirrored", cpu_replicas=3), "layers")
    assert launched.call_count == 3 * 6  # a trace of each replica: each random layer once


def test_a_layer_mixing_rows_is_refused_in_one_line():
    """MixUp mixes the batch's rows: each replica would mix its own slice (not one device's)."""
    strategy = get("mirrored", cpu_replicas=2)
    x, y = _data(SAMPLES, 1, "augment")
    with strategy.scope():
        model = keras.Sequential([keras.Input((6, 6, 1)), keras.layers.MixUp(), keras.layers.Flatten(),
                                  keras.layers.Dense(2)])  # fmt: skip
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    message = (r"^Layer 'mix_up\w*' \(MixUp\) mixes the rows of a batch: cut into 2 replicas, each piece "
               r"would mix its own rows, not one device's batch\. Apply it in the input pipeline "
               r"\(dataset\.map\) instead\.$")  # fmt: skip
    with pytest.raises(tfscale.Error, match=message):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=BATCH, verbose=0)  # in inference MixUp draws nothing: not refused


def test_a_random_layer_on_several_tensors_is_refused_in_one_line():
    strategy = get("mirrored", cpu_replicas=2)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.integers(0, 2, 16)
    with strategy.scope():
        model = helpers.pair_noise_model()
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    message = (r"^Layer 'pair_noise' \(PairNoise\) draws random numbers from an input that is not one "
               r"tensor \(list\): tfscale cannot give each replica its rows of one device's draws\. Pass one "
               r"tensor, or replica_random=True to keep per-replica draws\.$")  # fmt: skip
    with pytest.raises(tfscale.Error, match=message):
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def test_replica_random_must_be_a_bool():
    with pytest.raises(StrategyError, match=r"^Invalid value for argument `replica_random`\. Received: "
                       r"replica_random=1\. Expected True or False\.$"):  # fmt: skip
        get("mirrored", cpu_replicas=2, replica_random=1)


test_fix_is_version_gated = version_gate_test(keras_random_layers)


def test_apply_is_a_no_op_where_upstream_is_fixed_or_a_method_is_gone():
    layer_class = keras.layers.GaussianNoise
    before = layer_class.call
    for patch in (
        mock.patch.object(keras_random_layers, "_FIXED_IN", "3.0.0"),
        mock.patch.object(layer_class, "call", lambda self, inputs: inputs),
    ):
        with mock.patch.object(keras_random_layers, "_state", {"applied": False, "originals": []}), patch:
            assert keras_random_layers.apply() is False
        assert layer_class.call is before
    assert tfscale.compat.apply_strategy_fixes()["random_layers"] is True
