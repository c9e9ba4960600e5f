"""Model split: training steps/s and per-device parameter bytes for K = 1, 2, 4 devices.

An MLP (`--width` wide, `--layers` Dense layers, all sizes divisible by 4) is trained with
`train_on_batch` on synthetic data: unsplit on one device (K=1), layer split over K logical
CPU devices, and tensor split (Megatron column/row pairs) over K devices. Per-device bytes
are read from each variable's device (`ModelSplitStrategy.report`). Logical CPU devices
share the same cores, so steps/s here shows the overhead of the split (extra ops, copies
between devices), not the speed-up or capacity real accelerators would give; the bytes
column is what the split is for: each device holds 1/K of the model.

Steps/s come from paired rounds (`bench/_paired.py`): each round times `--steps` steps of
every variant, and `x unsplit` is each round's ratio to that round's unsplit rate (median,
min, max), beside an A/A control.

Run: python bench/bench_model_split.py [--width 1024] [--layers 4] [--batch 64] [--steps 30] [--repeats 3]
Writes bench/results/model_split.json.
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _paired  # bench/ is not a package: the script's folder is on sys.path

NUM_DEVICES = 4


def _model(keras, width, layers):
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
    return keras.Sequential([keras.Input((width,)), *dense, keras.layers.Dense(width)])


def _steps_per_second(model, x, y, steps):
    def measure():
        start = time.perf_counter()
        for _ in range(steps):
            model.train_on_batch(x, y)
        return steps / (time.perf_counter() - start)

    return measure


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
    models = {}
    for mode, k, options in runs:
        model = _model(keras, args.width, args.layers)
        if options is not None:
            model = strategies.get("model_split", **options).split(model)
        model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse")
        model.train_on_batch(x, y)  # Traces the step function.
        models[(mode, k)] = model
    # Paired rounds: each round times every variant once, each ratio to its round's unsplit rate.
    summary = _paired.run(
        {f"{mode} K={k}": _steps_per_second(m, x, y, args.steps) for (mode, k), m in models.items()},
        baseline="unsplit K=1",
        rounds=args.repeats,
    )
    rows = []
    for (mode, k), model in models.items():
        paired = summary["variants"][f"{mode} K={k}"]
        per_device = _bytes_per_device(model, device_of)
        rows.append(
            {
                "mode": mode,
                "k": k,
                "steps_per_s": round(paired["value"]["median"], 2),
                "vs_unsplit": paired["ratio"],
                "total_param_bytes": sum(per_device.values()),
                "max_device_param_bytes": max(per_device.values()),
                "param_bytes_per_device": per_device,
            }
        )
    _print(rows, args)
    control = summary["variants"][_paired.CONTROL]["ratio"]
    print(
        f"x unsplit: median [min, max] of {args.repeats} paired rounds; A/A control (unsplit again) "
        f"{control['median']:.3f} [{control['min']:.3f}, {control['max']:.3f}]; load average at start "
        f"{_paired._fmt_load(summary['load_start'])}, at end {_paired._fmt_load(summary['load_end'])}"
    )
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/model_split.json", "w") as f:
        json.dump({"args": vars(args), "rows": rows, "paired": summary}, f, indent=2)


def _print(rows, args):
    print(f"MLP {args.layers} x Dense({args.width}), batch {args.batch}, {NUM_DEVICES} logical CPU devices")
    print(
        f"{'mode':<8} {'K':>2} {'x unsplit':>9} {'min':>6} {'max':>6} {'steps/s':>8} "
        f"{'max MB/device':>14}  per-device MB"
    )
    for row in rows:
        per = " ".join(f"{b / 2**20:.2f}" for _, b in sorted(row["param_bytes_per_device"].items()))
        mb = row["max_device_param_bytes"] / 2**20
        ratio = row["vs_unsplit"]
        print(
            f"{row['mode']:<8} {row['k']:>2} {ratio['median']:>9.3f} {ratio['min']:>6.3f} "
            f"{ratio['max']:>6.3f} "
            f"{row['steps_per_s']:>8.1f} {mb:>14.2f}  {per}"
        )


if __name__ == "__main__":
    main()
