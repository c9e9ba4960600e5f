"""tfscale.compat.keras_loss_denominator: a mean loss under `mirrored` is the one-device mean.

Every run trains under `get("mirrored", cpu_replicas=2)` and is compared with plain Keras on
one device (same seed, data, order): the per-epoch logged losses, the final weights and
`evaluate`, to float32 round-off (the replicas' partial sums are added in another order).
Each scenario is one way the replicas' local denominators differ: an uneven last batch (2
and 1 samples), an empty slice (1 and 0), per-timestep masks with different valid counts
per replica on even batches, and the same with sample weights, class weights,
`"mean_with_sample_weight"`, a `"sum"` loss (whose log was off) and two outputs with
their own losses. `test_stock_keras_differs` keeps the scenarios honest: without the fix
each of them is off by far more than the tolerance.
"""

import functools
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf
from _compat_gate import version_gate_test

import tfscale.compat
from tfscale.compat import keras_loss_denominator
from tfscale.strategies import get

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_mirrored_matches_one_device": 2,
    "test_stock_keras_differs": 1,
}

BATCH, EPOCHS = 8, 2
TOLERANCE = 1e-6


def _sequences(samples, rng):
    """Token ids with trailing padding (0): 1 to 6 valid steps a sample."""
    x = rng.integers(1, 8, (samples, 6)).astype("int32")
    lengths = rng.integers(1, 7, samples)
    x[np.arange(6)[None, :] >= lengths[:, None]] = 0
    return x


def _scenario(name):
    """(samples, per-timestep?, fit keyword arguments, loss reduction, tf.data?) of a scenario."""
    weights = np.linspace(0.5, 2.0, 19).astype("float32")
    timestep_weights = np.linspace(0.5, 2.0, 19 * 6).reshape(19, 6).astype("float32")
    return {
        "uneven_numpy": (19, False, {}, "sum_over_batch_size", False),
        "empty_slice_tf_data": (17, False, {}, "sum_over_batch_size", True),
        "timestep_mask": (16, True, {}, "sum_over_batch_size", False),
        "timestep_mask_uneven_sample_weight": (
            19, True, {"sample_weight": timestep_weights}, "sum_over_batch_size", False,
        ),
        "class_weight": (19, False, {"class_weight": {0: 1.0, 1: 3.0}}, "sum_over_batch_size", False),
        "mean_with_sample_weight": (19, False, {"sample_weight": weights}, "mean_with_sample_weight", False),
        "timestep_mask_mean_with_sample_weight": (
            19, True, {"sample_weight": timestep_weights}, "mean_with_sample_weight", False,
        ),
        "sum": (19, False, {}, "sum", False),
        "two_outputs": (19, True, {}, "sum_over_batch_size", False),
    }[name]  # fmt: skip


SCENARIOS = (
    "uneven_numpy", "timestep_mask", "two_outputs", "empty_slice_tf_data",
    "timestep_mask_uneven_sample_weight", "class_weight", "mean_with_sample_weight",
    "timestep_mask_mean_with_sample_weight", "sum",
)  # fmt: skip


def _model(name, timestep, reduction):
    L = keras.layers
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)
    if name == "two_outputs":
        tokens = keras.Input((6,), dtype="int32")
        hidden = L.Embedding(8, 4, mask_zero=True)(tokens)
        tags = L.Dense(2, name="tags")(L.GRU(4, return_sequences=True)(hidden))
        value = L.Dense(1, name="value")(L.GRU(3)(hidden))
        model = keras.Model(tokens, {"tags": tags, "value": value})
        model.compile(
            keras.optimizers.Adam(0.05),
            loss={"tags": loss, "value": "mse"},
            loss_weights={"tags": 1.0, "value": 0.5},
            metrics={"tags": ["accuracy"], "value": ["mae"]},
        )
        return model
    if timestep:
        layers = [keras.Input((6,), dtype="int32"), L.Embedding(8, 4, mask_zero=True),
                  L.GRU(4, return_sequences=True), L.Dense(2)]  # fmt: skip
    else:
        layers = [keras.Input((4,)), L.Dense(8, "tanh"), L.Dense(2)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(0.05), loss, metrics=["accuracy"])
    return model


def _data(name):
    samples, timestep, kwargs, _, _ = _scenario(name)
    rng = np.random.default_rng(1)
    x = _sequences(samples, rng) if timestep else rng.normal(size=(samples, 4)).astype("float32")
    y = rng.integers(0, 2, (samples, 6) if timestep else samples).astype("int32")
    if name == "two_outputs":
        y = {"tags": y, "value": rng.normal(size=(samples, 1)).astype("float32")}
    kwargs = {k: (v[:samples] if isinstance(v, np.ndarray) else v) for k, v in kwargs.items()}
    return x, y, kwargs


def _train(strategy, name):
    """(history, weights, evaluate) of the scenario trained under `strategy`."""
    _, timestep, _, reduction, as_dataset = _scenario(name)
    x, y, kwargs = _data(name)
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = _model(name, timestep, reduction)
    if as_dataset:
        fit_args, kwargs = (tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH),), {}
    else:
        fit_args, kwargs = (x, y), {"batch_size": BATCH, **kwargs}
    history = model.fit(*fit_args, epochs=EPOCHS, shuffle=False, verbose=0, **kwargs).history
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return history, model.get_weights(), evaluated


@functools.cache
def _reference(name):
    return _train(tf.distribute.get_strategy(), name)


def _differences(got, want):
    """{what: largest absolute difference beyond round-off scale} for every compared value."""
    out = {}
    for key in want[0]:
        out[f"history.{key}"] = float(np.max(np.abs(np.subtract(got[0][key], want[0][key]))))
    out["weights"] = max(float(np.max(np.abs(g - w))) for g, w in zip(got[1], want[1]))
    for key in want[2]:
        out[f"evaluate.{key}"] = abs(got[2][key] - want[2][key])
    return out


def test_the_mask_scenario_gives_the_replicas_different_valid_counts():
    """Even batches (4 + 4), yet each batch's halves hold different numbers of valid steps."""
    x = _data("timestep_mask")[0]
    valid = (x != 0).reshape(-1, 2, BATCH // 2, 6).sum(axis=(2, 3))
    assert all(first != second for first, second in valid)


def _off(got, want):
    """The compared values of `got` off from `want` by more than TOLERANCE (relative to their size)."""
    return {k: v for k, v in _differences(got, want).items() if v > TOLERANCE * (1 + abs(_scale(want, k)))}


def _scale(run, key):
    if key.startswith("history."):
        return float(np.max(np.abs(run[0][key[len("history.") :]])))
    if key.startswith("evaluate."):
        return float(run[2][key[len("evaluate.") :]])
    return 0.0


@pytest.mark.parametrize("name", SCENARIOS)
def test_mirrored_matches_one_device(name):
    got = _train(get("mirrored", cpu_replicas=2), name)
    assert keras_loss_denominator.is_applied()
    off = _off(got, _reference(name))
    assert not off, off


def multi_worker_runs(names):
    """In each task of a cluster: the scenarios `names` under `get("multi_worker", cpu_replicas=2)`."""
    strategy = get("multi_worker", cpu_replicas=2)
    runs = {name: _train(strategy, name) for name in names}
    return {"replicas": strategy.num_replicas_in_sync, "runs": runs}


@pytest.mark.slow
def test_multi_worker_matches_one_device():
    """2 workers x 2 replicas (Keras's multi-worker path, the same fix): 3 samples split 1, 1, 1
    and an empty slice; 1 sample, three empty slices; masks with different valid counts."""
    from tfscale.launch import run_local_cluster

    names = ("uneven_numpy", "empty_slice_tf_data", "timestep_mask")
    results = run_local_cluster(
        multi_worker_runs, 2, args=(names,), timeout=400, env={"TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    for result in results:
        assert result.value["replicas"] == 4
        for name in names:
            off = _off(result.value["runs"][name], _reference(name))
            assert not off, (name, off)


def _train_stock(name):
    strategy = get("mirrored", cpu_replicas=2)  # Applies the fix; undone for this run.
    keras_loss_denominator._unapply()
    try:
        return _train(strategy, name)
    finally:
        keras_loss_denominator.apply()


@pytest.mark.parametrize("name", SCENARIOS)
def test_stock_keras_differs(name):
    """Keras's per-replica mean: the same scenario, the fix undone, is off by >1e-4 somewhere."""
    differences = _differences(_train_stock(name), _reference(name))
    assert max(differences.values()) > 1e-4, differences


test_fix_is_version_gated = version_gate_test(keras_loss_denominator)


def test_apply_is_a_no_op_where_upstream_is_fixed_or_the_functions_are_gone():
    from keras.src.losses import loss

    before = loss.reduce_weighted_values
    for patch in (
        mock.patch.object(keras_loss_denominator, "_FIXED_IN", "3.0.0"),
        mock.patch.object(loss, "scale_loss_for_distribution", None),
    ):
        with mock.patch.object(keras_loss_denominator, "_state", {"applied": False, "original": None}), patch:
            assert tfscale.compat.apply_loss_fixes() is False
        assert loss.reduce_weighted_values is before


@pytest.mark.slow
def test_hand_built_strategy_needs_one_explicit_call():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    assert tfscale.compat.apply_loss_fixes() is True
    assert tfscale.compat.apply_loss_fixes() is True  # idempotent
    got = _train(strategy, "uneven_numpy")
    assert max(_differences(got, _reference("uneven_numpy")).values()) < 1e-5
