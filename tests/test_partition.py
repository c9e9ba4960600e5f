"""The shared partitioner: the chain of layers, the balance methods, the per-part report."""

import itertools

import keras
import numpy as np
import pytest

from tfscale.strategies import BalanceError
from tfscale.strategies._partition import balance, chain_layers, describe, partition


def _mlp(widths=(8, 32, 4, 64, 16), input_dim=6):
    return keras.Sequential(
        [keras.Input((input_dim,))] + [keras.layers.Dense(w, name=f"d{i}") for i, w in enumerate(widths)]
    )


def _brute_force_max(weights, parts):
    """The least largest-part weight, over every way to cut (reference for the DP)."""
    best = float("inf")
    for cuts in itertools.combinations(range(1, len(weights)), parts - 1):
        bounds = (0, *cuts, len(weights))
        best = min(best, max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:])))
    return best


def test_chain_of_sequential_is_its_layers():
    model = _mlp()
    assert chain_layers(model) == model.layers


def test_chain_of_functional_is_topological_without_inputs():
    x = keras.Input((5,))
    a = keras.layers.Dense(4, name="a")(x)
    b = keras.layers.ReLU(name="b")(a)
    c = keras.layers.Dense(2, name="c")(b)
    model = keras.Model(x, c)
    assert [layer.name for layer in chain_layers(model)] == ["a", "b", "c"]


def test_skip_connection_is_refused_naming_the_merge():
    x = keras.Input((5,))
    a = keras.layers.Dense(5, name="a")(x)
    b = keras.layers.Dense(5, name="b")(a)
    c = keras.layers.Add(name="merge")([a, b])
    with pytest.raises(BalanceError, match=r"layer 'b'.*feeds 2 layers|layer 'a'.*feeds 2 layers"):
        chain_layers(keras.Model(x, c))


def test_merge_of_two_inputs_is_refused():
    x, y = keras.Input((5,)), keras.Input((5,))
    out = keras.layers.Dense(1, name="head")(keras.layers.Concatenate(name="cat")([x, y]))
    with pytest.raises(BalanceError, match=r"2 input\(s\) and 1 output\(s\)"):
        chain_layers(keras.Model([x, y], out))


def test_shared_layer_is_refused():
    x = keras.Input((5,))
    shared = keras.layers.Dense(5, name="shared")
    with pytest.raises(BalanceError, match=r"layer 'shared'.*called 2 times"):
        chain_layers(keras.Model(x, shared(shared(x))))


def test_subclassed_model_is_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__(name="net")
            self.dense = keras.layers.Dense(2)

        def call(self, x):
            return self.dense(x)

    with pytest.raises(BalanceError, match=r"'net' of class Net"):
        chain_layers(Net())


@pytest.mark.parametrize("weights", [[5, 1, 1, 1, 9, 2, 2, 7], [1, 1, 1, 1, 1, 1, 1], [30, 1, 2, 3, 40, 1]])
@pytest.mark.parametrize("parts", [1, 2, 3, 4])
def test_partition_minimises_the_largest_part_exactly(weights, parts):
    counts = partition(weights, parts)
    assert len(counts) == parts and sum(counts) == len(weights) and min(counts) >= 1
    bounds = np.cumsum([0, *counts])
    largest = max(sum(weights[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert largest == _brute_force_max(weights, parts)
    assert largest <= sum(weights) / parts + max(weights)  # The documented tolerance.


def test_uniform_balances_layer_counts():
    layers = _mlp(widths=(3,) * 10).layers
    counts = balance(layers, 4, "uniform")
    assert sorted(counts) == [2, 2, 3, 3] and sum(counts) == 10


def test_parameters_balances_parameter_counts():
    model = _mlp()
    layers = model.layers
    counts = balance(layers, 2, "parameters")
    params = [layer.count_params() for layer in layers]
    bounds = np.cumsum([0, *counts])
    largest = max(sum(params[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert largest == _brute_force_max(params, 2)


def test_parameter_free_layers_are_spread_not_piled():
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4)] + [keras.layers.ReLU() for _ in range(5)]
    )
    counts = balance(model.layers, 3, "parameters")
    assert counts[0] == 1 and sorted(counts[1:]) == [2, 3]


def test_time_gives_the_slow_layer_its_own_part():
    model = keras.Sequential(
        [keras.Input((512,)), keras.layers.Dense(2048, name="slow")]
        + [keras.layers.Activation("linear") for _ in range(3)]
    )
    counts = balance(model.layers, 2, "time", sample_input=np.ones((128, 512), "float32"))
    assert counts == [1, 3]


def test_time_without_sample_input_is_refused():
    with pytest.raises(BalanceError, match=r"`sample_input`.*sample_input=None"):
        balance(_mlp().layers, 2, "time")


def test_explicit_counts_are_returned():
    assert balance(_mlp().layers, 2, [2, 3]) == [2, 3]


@pytest.mark.parametrize("counts", [[5], [2, 2], [0, 5], [1, 1, 3], [2.0, 3]])
def test_invalid_explicit_counts_are_refused(counts):
    with pytest.raises(BalanceError, match=r"Expected 2 positive layer counts summing to 5"):
        balance(_mlp().layers, 2, counts)


def test_too_many_parts_carries_both_numbers_and_a_fix():
    with pytest.raises(
        BalanceError, match=r"too few layers to make 4 parts \(layers: 3, parts: 4\)\. Use at"
    ):
        balance(_mlp(widths=(2, 2, 2)).layers, 4)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_invalid_num_parts_is_refused(bad):
    with pytest.raises(BalanceError, match=r"`num_parts`"):
        balance(_mlp().layers, bad)


def test_unknown_method_lists_the_choices():
    with pytest.raises(BalanceError, match=r"balance='flops'.*'parameters', 'uniform', 'time'"):
        balance(_mlp().layers, 2, "flops")


def test_parameters_on_unbuilt_layers_is_refused():
    model = keras.Sequential([keras.layers.Dense(2, name="lazy"), keras.layers.Dense(2)])
    with pytest.raises(BalanceError, match=r"'lazy' is not built"):
        balance(model.layers, 2)


def test_describe_reports_params_and_bytes_per_part():
    model = _mlp()
    report = describe(model.layers, [2, 3], ["/device:CPU:0", "/device:CPU:1"])
    first = model.layers[0].count_params() + model.layers[1].count_params()
    assert report[0] == {
        "device": "/device:CPU:0",
        "layers": ["d0", "d1"],
        "params": first,
        "param_bytes": 4 * first,
    }
    assert report[1]["params"] == model.count_params() - first
