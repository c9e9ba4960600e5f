"""What do one device's Dropout masks cost under `mirrored`? Keras `fit` steps/s with
tfscale's default (each replica draws its rows of the whole batch's mask:
`tfscale/compat/keras_random_layers.py`) vs `replica_random=True` (Keras's own per-replica
draws), and vs one device on the same cores.

Paired rounds in one process (`bench/_paired.py`): each round times one whole `fit` epoch
(after a warm-up epoch) of each variant and an A/A control (the per-replica model again),
in an order that changes each round; each figure is a variant's steps/s over the same
round's per-replica steps/s; median, min and max, and the load average, are printed.
The model is Dropout-heavy on purpose (a Dropout after every Dense): an upper bound of the
cost for models whose Dropout is a smaller share of the step.

Run: python bench/bench_dropout.py [--replicas 2] [--rounds 7] [--steps 100]
Writes bench/results/dropout.json.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _paired  # bench/ is not a package: the script's folder is on sys.path

PER_REPLICA = "per-replica draws"


def _model(keras, width, depth):
    keras.utils.set_random_seed(0)
    hidden = []
    for _ in range(depth):
        hidden += [keras.layers.Dense(width, activation="relu"), keras.layers.Dropout(0.3)]
    model = keras.Sequential([keras.Input((64,)), *hidden, keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "dropout.json"))
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    import tfscale.strategies

    tfscale.strategies.split_cpu(args.replicas)
    strategies = {
        PER_REPLICA: tfscale.strategies.get("mirrored", cpu_replicas=args.replicas, replica_random=True),
        "one device's masks": tfscale.strategies.get("mirrored", cpu_replicas=args.replicas),
        "one device": tfscale.strategies.get("one_device", device="/cpu:0"),
    }
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 64)).astype("float32")
    y = rng.integers(0, 10, size=(args.steps * args.batch,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache().prefetch(2)

    def steps_per_s(strategy):
        with strategy.scope():
            model = _model(keras, args.width, args.depth)
        model.fit(dataset, epochs=1, verbose=0)  # trace and warm up

        def fit():
            start = time.perf_counter()
            model.fit(dataset, epochs=1, verbose=0)
            return args.steps / (time.perf_counter() - start)

        return fit

    summary = _paired.run(
        {label: steps_per_s(s) for label, s in strategies.items()},
        baseline=PER_REPLICA,
        rounds=args.rounds,
        log=print,
    )
    print(
        f"Keras fit, Dropout after each of {args.depth} Dense({args.width}), MirroredStrategy over "
        f"{args.replicas} logical CPUs, {args.steps} steps x batch {args.batch}, {args.rounds} paired rounds"
    )
    print(_paired.format_table(summary, what=f"steps/s / {PER_REPLICA}", percent=False))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "paired": summary}, f, indent=2)


if __name__ == "__main__":
    main()
