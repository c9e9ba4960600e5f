"""tfscale.compat.keras_batch_norm: BatchNormalization under `mirrored` trains as on one device.

Each model trains under `get("mirrored", cpu_replicas=N)` (N = 2, 4) and is compared with
plain Keras on one device (same seed, data, order): the per-epoch logged losses, every
weight (BatchNormalization's moving mean and variance included), `evaluate` and `predict`,
to 1e-5 absolute plus 1e-5 relative. The models: a chain (19 samples in batches of 8: the
last batch splits 2 + 1 over 2 replicas, 1 + 1 + 1 + 0 over 4), BatchNormalization nested
in a sub-model and in a custom layer (the sub-model's saved config still says
`synchronized: false`), and a masked one (Keras's masked moments; replicas hold different
numbers of valid steps); also 2 workers x 2 replicas, and a model whose layers were made
before the fix was applied. `test_stock_keras_differs` keeps them honest: without the fix
each is off by more than 1e-4. One replica and `replica_statistics=True` launch nothing.
"""

import functools
import json
import zipfile
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from _compat_gate import version_gate_test

import tfscale.compat
from tfscale.compat import keras_batch_norm
from tfscale.strategies import StrategyError, get

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_mirrored_matches_one_device": 3,
    "test_stock_keras_differs": 1,
}

BATCH, EPOCHS = 8, 2
TOLERANCE = 1e-5  # absolute, and relative: the replicas' partial sums are added in another order
MODELS = ("chain", "nested", "masked")
SAMPLES = {"chain": 19, "nested": 19, "masked": 16}


class _Block(keras.layers.Layer):
    """A custom layer with its own Dense and BatchNormalization."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(6, use_bias=False)
        self.norm = keras.layers.BatchNormalization(momentum=0.5)

    def call(self, x, training=None):
        return keras.ops.tanh(self.norm(self.dense(x), training=training))


def _model(name):
    L = keras.layers
    # No bias before a BatchNormalization: its gradient is zero (the mean is removed).
    if name == "chain":
        model = keras.Sequential([keras.Input((4,)), L.Dense(8, use_bias=False), L.BatchNormalization(),
                                  L.Activation("tanh"), L.Dense(2)])  # fmt: skip
    elif name == "nested":
        inputs = keras.Input((4,))
        hidden = L.Dense(8, use_bias=False)(inputs)
        inner = keras.Sequential([L.BatchNormalization(momentum=0.5), L.Activation("tanh")], name="inner")
        outputs = L.Dense(2)(_Block()(inner(hidden)))
        model = keras.Model(inputs, outputs)
    else:  # masked: zero time steps are masked, the moments count only the valid ones
        model = keras.Sequential([keras.Input((5, 3)), L.Masking(), L.Dense(4, use_bias=False),
                                  L.BatchNormalization(momentum=0.5), L.GlobalAveragePooling1D(),
                                  L.Dense(2)])  # fmt: skip
    model.compile(
        keras.optimizers.SGD(0.1, momentum=0.9),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data(name, samples, seed):
    rng = np.random.default_rng(seed)
    if name == "masked":
        x = rng.normal(1.0, 2.0, size=(samples, 5, 3)).astype("float32")
        lengths = rng.integers(1, 6, samples)
        x[np.arange(5)[None, :] >= lengths[:, None]] = 0.0
    else:
        x = rng.normal(1.0, 2.0, size=(samples, 4)).astype("float32")
    return x, rng.integers(0, 2, samples).astype("int32")


def _built(strategy, name):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        return _model(name)


def _train(strategy, name, save_to=None, model=None):
    """{what: values} of the model `name` (built now, unless given) trained under `strategy`."""
    x, y = _data(name, SAMPLES[name], seed=1)
    xv, yv = _data(name, BATCH, seed=2)
    model = model or _built(strategy, name)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0).history
    if save_to is not None:
        model.save(save_to)
    return {
        **{f"history.{k}": np.asarray(v) for k, v in history.items()},
        "weights": model.get_weights(),
        "evaluate": np.asarray(model.evaluate(xv, yv, batch_size=BATCH, verbose=0)),
        "predict": model.predict(xv, batch_size=BATCH, verbose=0),
    }


@functools.cache
def _reference(name):
    return _train(tf.distribute.get_strategy(), name)


def _largest_difference(got, want):
    return max(
        float(np.max(np.abs(np.subtract(g, w))))
        for key in want
        for g, w in zip(_list(got[key]), _list(want[key]))
    )


def _list(value):
    return value if isinstance(value, list) else [value]


def _assert_equal(got, want):
    assert set(got) == set(want)
    for key in want:
        assert len(_list(got[key])) == len(_list(want[key])), key
        for i, (g, w) in enumerate(zip(_list(got[key]), _list(want[key]))):
            np.testing.assert_allclose(g, w, rtol=TOLERANCE, atol=TOLERANCE, err_msg=f"{key}[{i}]")


def _saved_batch_norm_configs(path):
    with zipfile.ZipFile(path) as saved:
        config = json.loads(saved.read("config.json"))
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("class_name") == "BatchNormalization":
                found.append(node["config"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(config)
    return found


@pytest.mark.parametrize("replicas", [2, 4])
@pytest.mark.parametrize("name", MODELS)
def test_mirrored_matches_one_device(name, replicas, tmp_path):
    strategy = get("mirrored", cpu_replicas=replicas)
    assert keras_batch_norm.is_applied()
    got = _train(strategy, name, save_to=tmp_path / "model.keras" if name == "nested" else None)
    _assert_equal(got, _reference(name))
    if name == "nested":  # the user's model as written: no layer was made `synchronized`
        configs = _saved_batch_norm_configs(tmp_path / "model.keras")
        assert [c["synchronized"] for c in configs] == [False]  # the sub-model's (the block's is built in)


def test_layers_made_before_the_fix_was_applied_take_the_global_batch_too():
    """The fix is on the class: layers (and their model) that exist before it take it too."""
    strategy = get("mirrored", cpu_replicas=2)
    keras_batch_norm._unapply()
    try:
        model = _built(strategy, "nested")
    finally:
        keras_batch_norm.apply()
    _assert_equal(_train(strategy, "nested", model=model), _reference("nested"))


def multi_worker_runs(names):
    """In each task of a cluster: the models `names` under `get("multi_worker", cpu_replicas=2)`."""
    strategy = get("multi_worker", cpu_replicas=2)
    runs = {name: _train(strategy, name) for name in names}
    return {"replicas": strategy.num_replicas_in_sync, "runs": runs}


@pytest.mark.slow
def test_multi_worker_matches_one_device():
    """2 workers x 2 replicas: the moments are all-reduced across the workers too."""
    from tfscale.launch import run_local_cluster

    names = ("chain", "masked")
    results = run_local_cluster(
        multi_worker_runs, 2, args=(names,), timeout=400, env={"TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    for result in results:
        assert result.value["replicas"] == 4
        for name in names:
            _assert_equal(result.value["runs"][name], _reference(name))


def _train_stock(name, replicas=2):
    strategy = get("mirrored", cpu_replicas=replicas)  # Applies the fix; undone for this run.
    keras_batch_norm._unapply()
    try:
        return _train(strategy, name)
    finally:
        keras_batch_norm.apply()


@pytest.mark.parametrize("name", MODELS)
def test_stock_keras_differs(name):
    """Keras's per-replica statistics: the same model, the fix undone, is off by >1e-4."""
    assert _largest_difference(_train_stock(name), _reference(name)) > 1e-4


def _launches():
    """A mock counting the fix's all-reduces as they are traced (and still making them)."""
    return mock.patch.object(
        keras_batch_norm, "_sum_over_replicas", wraps=keras_batch_norm._sum_over_replicas
    )


def test_one_replica_and_replica_statistics_launch_nothing_and_train_as_keras():
    with _launches() as launched:
        alone = _train(get("mirrored", cpu_replicas=1), "chain")
        kept = _train(get("mirrored", cpu_replicas=2, replica_statistics=True), "chain")
    assert launched.call_count == 0
    _assert_equal(alone, _reference("chain"))  # one replica is one device
    stock = _train_stock("chain")
    for key in stock:  # Keras's own per-replica statistics, as asked
        for g, w in zip(_list(kept[key]), _list(stock[key])):
            np.testing.assert_array_equal(g, w, err_msg=key)
    with _launches() as launched:
        _train(get("mirrored", cpu_replicas=2), "chain")
    assert launched.call_count > 0  # two a trace of each replica (the backward launches inside them)


def test_replica_statistics_must_be_a_bool():
    with pytest.raises(StrategyError, match=r"^Invalid value for argument `replica_statistics`\. Received: "
                       r"replica_statistics='yes'\. Expected True or False\.$"):  # fmt: skip
        get("mirrored", cpu_replicas=2, replica_statistics="yes")


test_fix_is_version_gated = version_gate_test(keras_batch_norm)


def test_apply_is_a_no_op_where_upstream_is_fixed_or_the_method_is_gone():
    layer_class = keras.layers.BatchNormalization
    before = layer_class._moments
    for patch in (
        mock.patch.object(keras_batch_norm, "_FIXED_IN", "3.0.0"),
        mock.patch.object(layer_class, "_moments", lambda self, inputs: None),
    ):
        with mock.patch.object(keras_batch_norm, "_state", {"applied": False, "original": None}), patch:
            assert keras_batch_norm.apply() is False
        assert layer_class._moments is before
    assert tfscale.compat.apply_strategy_fixes()["batch_norm"] is True
