"""Does the tfscale layer cost speed? Keras `fit` steps/s under
`tfscale.strategies.get("mirrored", cpu_replicas=N)` vs a hand-built
`tf.distribute.MirroredStrategy` over the same logical CPU devices.

Paired rounds in one process (`bench/_paired.py`): each round times one whole `fit`
epoch (after a warm-up epoch) under each strategy and an A/A control (the hand-built
one again), in an order that changes each round; each round's ratio is tfscale's
steps/s over the hand-built one's; the median, min and max and the load average are
printed. Goal: median ratio >= 0.98 (the thin layer costs nothing measurable).

Run: python bench/bench_strategies.py [--replicas 2] [--rounds 7] [--steps 200]
Writes bench/results/strategies.json.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _paired  # bench/ is not a package: the script's folder is on sys.path


def _model(keras, width):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def overhead_ratio(ours, hand_built, dataset, *, steps, rounds, width, log=None):
    """Paired rounds (`bench/_paired.py`) of one `fit` epoch under each strategy.

    Each round's figure is tfscale's steps/s over the hand-built strategy's steps/s in the
    same round; the A/A control is the hand-built model timed twice a round.
    """
    import keras

    models = {}
    for label, strategy in (("hand-built", hand_built), ("tfscale", ours)):
        with strategy.scope():
            model = _model(keras, width)
        model.fit(dataset, epochs=1, verbose=0)  # trace and warm up
        models[label] = model

    def steps_per_s(model):
        def fit():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            return steps / (time.perf_counter() - start)

        return fit

    return _paired.run(
        {label: steps_per_s(model) for label, model in models.items()},
        baseline="hand-built",
        rounds=rounds,
        log=log,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", "--repeats", type=int, default=7, dest="rounds")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "strategies.json")
    )
    args = parser.parse_args()

    import numpy as np
    import tensorflow as tf

    import tfscale.strategies

    devices = tfscale.strategies.split_cpu(args.replicas)
    hand_built = tf.distribute.MirroredStrategy(devices)
    ours = tfscale.strategies.get("mirrored", cpu_replicas=args.replicas)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 64)).astype("float32")
    y = rng.integers(0, 10, size=(args.steps * args.batch,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache().prefetch(2)

    summary = overhead_ratio(
        ours, hand_built, dataset, steps=args.steps, rounds=args.rounds, width=args.width
    )
    ratio = summary["variants"]["tfscale"]["ratio"]
    print(
        f"Keras fit, MirroredStrategy over {args.replicas} logical CPUs, {args.steps} steps x batch "
        f"{args.batch}, {args.rounds} paired rounds of one epoch each"
    )
    print(_paired.format_table(summary, what="steps/s / hand-built", percent=False))
    print(
        f"ratio tfscale / hand-built: median {ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}], "
        f"A/A control {summary['variants'][_paired.CONTROL]['ratio']['median']:.3f} (goal >= 0.98)"
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "paired": summary, "ratio": ratio["median"]}, f, indent=2)


if __name__ == "__main__":
    main()
