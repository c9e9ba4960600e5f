"""Model split: training steps/s and per-device parameter bytes for K = 1, 2, 4 devices.

An MLP (`--width` wide, `--layers` Dense layers, all sizes divisible by 4) is trained with
`train_on_batch` on synthetic data: unsplit on one device (K=1), layer split over K logical
CPU devices, and tensor split (Megatron column/row pairs) over K devices. Per-device bytes
are read from each variable's device (`ModelSplitStrategy.report`). Logical CPU devices
share the same cores, so steps/s here shows the overhead of the split (extra ops, copies
between devices), not the speed-up or capacity real accelerators would give; the bytes
column is what the split is for: each device holds 1/K of the model.

Run: python bench/bench_model_split.py [--width 1024] [--layers 4] [--batch 64] [--steps 30]
Writes bench/results/model_split.json.
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
NUM_DEVICES = 4


def _model(keras, width, layers):
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
    return keras.Sequential([keras.Input((width,)), *dense, keras.layers.Dense(width)])


def _steps_per_second(model, x, y, steps, repeats):
    model.train_on_batch(x, y)  # Traces the step function.
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            model.train_on_batch(x, y)
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def _bytes_per_device(model, device_of):
    found = {}
    for v in model.weights:
        device = device_of(v)
        found[device] = found.get(device, 0) + int(v.value.numpy().nbytes)
    return found


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from tfscale import strategies

    strategies.split_cpu(NUM_DEVICES)  # Before TensorFlow starts.
    import keras
    import numpy as np

    from tfscale.strategies._placement import device_of

    rng = np.random.RandomState(0)
    x = rng.randn(args.batch, args.width).astype("float32")
    y = rng.randn(args.batch, args.width).astype("float32")
    runs = [("unsplit", 1, None)]
    runs += [("layer", k, {"num_devices": k}) for k in (2, 4)]
    runs += [("tensor", k, {"tensor_parallel": k}) for k in (2, 4)]
    rows = []
    for mode, k, options in runs:
        model = _model(keras, args.width, args.layers)
        if options is not None:
            model = strategies.get("model_split", **options).split(model)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        rate = _steps_per_second(model, x, y, args.steps, args.repeats)
        per_device = _bytes_per_device(model, device_of)
        rows.append(
            {
                "mode": mode,
                "k": k,
                "steps_per_s": round(rate, 2),
                "total_param_bytes": sum(per_device.values()),
                "max_device_param_bytes": max(per_device.values()),
                "param_bytes_per_device": per_device,
            }
        )
    _print(rows, args)
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/model_split.json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


def _print(rows, args):
    print(f"MLP {args.layers} x Dense({args.width}), batch {args.batch}, {NUM_DEVICES} logical CPU devices")
    print(f"{'mode':<8} {'K':>2} {'steps/s':>8} {'max MB/device':>14}  per-device MB")
    for row in rows:
        per = " ".join(f"{b / 2**20:.2f}" for _, b in sorted(row["param_bytes_per_device"].items()))
        mb = row["max_device_param_bytes"] / 2**20
        print(f"{row['mode']:<8} {row['k']:>2} {row['steps_per_s']:>8.1f} {mb:>14.2f}  {per}")


if __name__ == "__main__":
    main()
