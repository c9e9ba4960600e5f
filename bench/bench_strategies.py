"""Does the tfscale layer cost speed? Keras `fit` steps/s under
`tfscale.strategies.get("mirrored", cpu_replicas=N)` vs a hand-built
`tf.distribute.MirroredStrategy` over the same logical CPU devices.

The two are timed alternately in one process (A, B, A, B, ...), each timing a
whole `fit` epoch after a warm-up epoch, and the ratio of the medians is printed.
Goal: ratio >= 0.98 (the thin layer costs nothing measurable).

Run: python bench/bench_strategies.py [--replicas 2] [--repeats 7] [--steps 200]
Writes bench/results/strategies.json.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument(
        "--out", default=os.path.join(os.path.dirname(__file__), "results", "strategies.json")
    )
    args = parser.parse_args()

    import keras
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

    runs = {}
    for label, strategy in (("tfscale", ours), ("hand-built", hand_built)):
        with strategy.scope():
            model = _model(keras, args.width)
        model.fit(dataset, epochs=1, verbose=0)  # trace and warm up
        runs[label] = {"model": model, "seconds": []}
    for _ in range(args.repeats):
        for run in runs.values():
            start = time.perf_counter()
            run["model"].fit(dataset, epochs=1, verbose=0)
            run["seconds"].append(time.perf_counter() - start)

    rows = {}
    for label, run in runs.items():
        steps_per_s = [args.steps / s for s in run["seconds"]]
        rows[label] = {"median_steps_per_s": statistics.median(steps_per_s), "steps_per_s": steps_per_s}
    ratio = rows["tfscale"]["median_steps_per_s"] / rows["hand-built"]["median_steps_per_s"]
    print(
        f"Keras fit, MirroredStrategy over {args.replicas} logical CPUs, {args.steps} steps x batch "
        f"{args.batch}, median of {args.repeats} alternated epochs"
    )
    print(f"{'strategy':<12} {'steps/s (median)':>17} {'min':>8} {'max':>8}")
    for label, row in rows.items():
        print(
            f"{label:<12} {row['median_steps_per_s']:>17.1f} {min(row['steps_per_s']):>8.1f} "
            f"{max(row['steps_per_s']):>8.1f}"
        )
    print(f"ratio tfscale / hand-built: {ratio:.3f} (goal >= 0.98)")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
