"""Quick start: train a small Keras model under `tfscale.strategies.get("auto")`.

Run: python examples/quickstart.py [--cpu_replicas N]
"""

import argparse

import numpy as np


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu_replicas", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()

    import keras

    import tfscale

    strategy = tfscale.strategies.get("auto", cpu_replicas=args.cpu_replicas)
    print(f"strategy: {type(strategy).__name__}, replicas: {strategy.num_replicas_in_sync}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 16)).astype("float32")
    y = (x @ rng.normal(size=(16,)) > 0).astype("int32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]
        )
        model.compile(
            optimizer=keras.optimizers.Adam(1e-2),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    history = model.fit(x, y, batch_size=128, epochs=args.epochs, verbose=2)
    print(f"final loss: {history.history['loss'][-1]:.4f}, accuracy: {history.history['accuracy'][-1]:.4f}")


if __name__ == "__main__":
    main()
