"""A small `fit` whose one-device result needs tfscale's global-batch Keras fixes (no tfscale import).

A per-timestep loss behind `Masking` (each sample has 1 to 6 valid steps), 19 samples in
global batches of 8 (the last batch, 3 samples, splits 2 and 1 over two replicas) and
`SGD(clipnorm=...)` small enough to clip every step. On 2 replicas of a hand-built
`MirroredStrategy` / `MultiWorkerMirroredStrategy`, stock Keras 3 differs from one device
twice over: each replica divides its loss by its own valid count (`keras_loss_denominator`)
and clips its own partial gradient before the all-reduce (`keras_optimizer`).
`train(strategy)` gives the same weights and losses as `train` on the default strategy (one
device) only with both fixes in effect. The initial weights come from numpy, not from
Keras's seeds, so every process starts from the same ones.
"""

import keras
import numpy as np

__all__ = ["BATCH", "EPOCHS", "train"]

SAMPLES, STEPS, FEATURES, BATCH, EPOCHS = 19, 6, 3, 8, 2


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(SAMPLES, STEPS, FEATURES)).astype("float32")
    lengths = rng.integers(1, STEPS + 1, SAMPLES)
    x[np.arange(STEPS)[None, :] >= lengths[:, None]] = 0.0  # Masking(0.0) hides these steps
    y = rng.integers(0, 2, (SAMPLES, STEPS)).astype("int32")
    return x, y


def train(strategy):
    """(final weights, per-epoch logged losses) of the probe trained under `strategy`."""
    x, y = _data()
    L = keras.layers
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((STEPS, FEATURES)), L.Masking(0.0), L.Dense(8, "tanh"), L.Dense(2)]
        )
        model.compile(
            keras.optimizers.SGD(0.5, clipnorm=0.05),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    rng = np.random.default_rng(4)
    model.set_weights([rng.normal(scale=0.5, size=w.shape).astype("float32") for w in model.get_weights()])
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], list(history.history["loss"])
