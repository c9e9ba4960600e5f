"""What the model-parallel tests share: seeded models, the one-device reference run, an interrupted fit.

test_pipeline, test_hybrid, test_generality and test_model_split each compare a split model
with the unsplit one trained on one device; the pieces they had written four times live here
once: a model built after seeding Keras, the tiny MLP and the uneven MLP, SGD-with-momentum
compile and a `fit` that returns the history, a per-key cache of the reference run, a fit
interrupted after its first epoch and resumed from a backup (of either class,
`each_backup_class`), fixed layer timings for the partitioner, and a model whose random layer takes a list
(`pair_noise_model`: the refusal of a random layer on several tensors).
test_data_parallel_keras_equivalence interrupts its fits the same way.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale.callbacks
from tfscale.strategies import _partition
from tfscale.strategies._placement import variable_device

__all__ = [
    "StopAfterEpoch",
    "assert_stage_placed",
    "assert_weights_close",
    "compile_sgd",
    "each_backup_class",
    "fit",
    "fix_layer_times",
    "interrupted_then_resumed",
    "mlp",
    "on_one_device",
    "once_per_key",
    "reference_runs",
    "regression_data",
    "seeded",
    "uneven_mlp",
]


def seeded(build, seed):
    """`build()` after seeding Keras: the same seed gives the same initial weights."""
    keras.utils.set_random_seed(seed)
    return build()


def seeded_twins(build, seed=3):
    """Two models of `build()` from one seed, the second given the first's weights (a reference
    and the one a mode splits: the same layers, names and starting point)."""
    model = seeded(build, seed)
    twin = seeded(build, seed)
    twin.set_weights(model.get_weights())
    return model, twin


def mlp(extra=0):
    """6 -> 3 regression MLP; `extra` more Dense(10, tanh) layers make room for more stages."""
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(12, activation="relu"),
            keras.layers.Dense(10, activation="tanh"),
            *[keras.layers.Dense(10, activation="tanh") for _ in range(extra)],
            keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(3),
        ],
        name="mlp",
    )


def uneven_mlp():
    """Parameters per layer 7*64, 64*2, 2*2, 2*64, 64*3 (+ biases): uniform differs from both."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((7,))] + [keras.layers.Dense(n) for n in (64, 2, 2, 64, 3)])


def regression_data(input_shape, samples, outputs=3, seed=1):
    """Normal inputs of `input_shape` and normal targets of `outputs` values (float32)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, *input_shape)).astype("float32")
    return x, rng.normal(size=(samples, outputs)).astype("float32")


def compile_sgd(model, learning_rate, **kwargs):
    """Compiles `model` with SGD (momentum 0.9) on mse, tracking mae; returns it."""
    optimizer = keras.optimizers.SGD(learning_rate, momentum=0.9)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"], **kwargs)
    return model


def fit(model, x, y, *, batch_size, epochs, **kwargs):
    """`model.fit` in order (no shuffle), silent; returns the history dict."""
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **kwargs).history


def once_per_key(run):
    """`run(key)` computed once per key and then served from a cache (the reference runs)."""
    done = {}

    def cached(key):
        if key not in done:
            done[key] = run(key)
        return done[key]

    return cached


def on_one_device(build_and_train):
    """`build_and_train()` on the first logical CPU: the unsplit reference run."""
    with tf.device("/device:CPU:0"):
        return build_and_train()


def reference_runs(model, data, compile_model, fit_model):
    """kind -> (history, final weights) of `model(kind)` trained unsplit on one device, once per kind."""

    def run(kind):
        def train():
            trained = compile_model(model(kind))
            return fit_model(trained, *data(kind)), trained.get_weights()

        return on_one_device(train)

    return once_per_key(run)


class StopAfterEpoch(keras.callbacks.Callback):
    """Interrupts `fit` at the end of its first epoch (after a backup callback listed before it)."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            raise RuntimeError("interrupted")


# A split model resumes from either backup: Keras's own and tfscale's (`backup_class`).
each_backup_class = pytest.mark.parametrize(
    "backup_class",
    [keras.callbacks.BackupAndRestore, tfscale.callbacks.BackupAndRestore],
    ids=["keras", "tfscale"],
)


def interrupted_then_resumed(first, make_second, backup, fit_model):
    """Fits `first` until `StopAfterEpoch` interrupts it, then a new model from `backup`.

    `make_second()` builds the model that resumes, after the interruption (as a restarted job
    would); `fit_model(model, callbacks)` runs a fit; `backup` (a BackupAndRestore) comes
    first in the callbacks so the epoch is backed up before the interruption.

    Returns:
        (the resumed model, its history).
    """
    with pytest.raises(RuntimeError, match="interrupted"):
        fit_model(first, [backup, StopAfterEpoch()])
    second = make_second()
    return second, fit_model(second, [backup])


def assert_stage_placed(stage, device, optimizer):
    """`stage` runs on `device`, and so do its trainable variables and their momentum slots."""
    assert stage.device == device
    momenta = {v.path.split("/", 1)[1]: v for v in optimizer.variables}
    for variable in stage.trainable_variables:
        assert variable_device(variable).endswith(device[1:])
        slot = momenta[variable.path.replace("/", "_") + "_momentum"]
        assert variable_device(slot).endswith(device[1:])


def assert_weights_close(got, want, *, rtol, atol):
    """Weight lists equal in length and close value by value."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def fix_layer_times(monkeypatch, seconds):
    """Layer timings the partitioner would have measured, fixed so the test is exact."""
    calls = iter(seconds)
    monkeypatch.setattr(_partition, "_time_layer", lambda layer, x: (layer(x), next(calls)))


class PairNoise(keras.layers.Layer):
    """A user's random layer on a list of two tensors: no one batch tensor to place its rows in."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.noise = keras.random.SeedGenerator(5)

    def call(self, inputs, training=False):
        first, second = inputs
        return first + second * keras.random.normal(keras.ops.shape(second), seed=self.noise)


def pair_noise_model():
    """Two Dense branches into `PairNoise` (a functional graph), then a Dense head."""
    keras.utils.set_random_seed(0)
    x = keras.Input((6,))
    mixed = PairNoise(name="pair_noise")([keras.layers.Dense(4)(x), keras.layers.Dense(4)(x)])
    return keras.Model(x, keras.layers.Dense(2)(mixed))
