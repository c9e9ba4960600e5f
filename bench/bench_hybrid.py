"""Pipeline x data parallel: DP4, PP4 and DP2 x PP2 on 4 logical CPU devices, one model and batch.

One MLP (`--layers` Dense layers `--width` wide) and one global batch for every config:

- DP4: 4 copies of the whole model (a 1-stage pipeline, `data_parallel=4`), M = 1;
- PP4: a 4-stage 1F1B pipeline, M = 8;
- DP2 x PP2: 2 copies of a 2-stage 1F1B pipeline, M = 4 per copy (same micro-batch as PP4).

Each config reports steps/s (median of `--repeats` timings of `--steps` `train_on_batch`
calls) and its `PipelinedModel.plan_report`: bytes sent between devices per step, counted
from the traced step (activations + gradients) beside the formula, and the most bytes one
device holds (parameters + Adam slots + the activations alive at the peak of a profiled
step). DP4 uses the same all-reduce (`strategies._replicas`) as the hybrid, so the three
differ only in shape.

Not here yet: the 2-process configs (stages on another process; pipeline in each process x
data parallel across processes), which need the multi-process pipeline work.

Logical CPU devices share the host's cores: steps/s shows the cost of each shape's extra
ops and copies on one CPU, not the speed-up of real accelerators; the bytes are what each
shape moves and holds, on any device.

Run: python bench/bench_hybrid.py [--width 512] [--layers 8] [--batch 64] [--steps 10]
Writes bench/results/hybrid.json (a list of rows: config, steps_per_s, bytes_measured,
bytes_formula, max_device_bytes, and the report's split of them).
"""

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
NUM_DEVICES = 4
# config -> (num_stages, data_parallel, num_microbatches)
CONFIGS = {"DP4": (1, 4, 1), "PP4 (M=8)": (4, 1, 8), "DP2 x PP2 (M=4)": (2, 2, 4)}


def _model(keras, width, layers):
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
    return keras.Sequential([keras.Input((width,)), *dense, keras.layers.Dense(10)])


def _steps_per_second(model, x, y, steps, repeats):
    model.train_on_batch(x, y)  # Traces the step function.
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            model.train_on_batch(x, y)
        rates.append(steps / (time.perf_counter() - start))
    return statistics.median(rates)


def _row(config, rate, report):
    return {
        "config": config,
        "steps_per_s": round(rate, 3),
        "bytes_measured": report.bytes_measured,
        "bytes_formula": report.bytes_formula,
        "max_device_bytes": report.max_device_bytes,
        "activation_bytes_measured": report.activation_bytes_measured,
        "activation_bytes_formula": report.activation_bytes_formula,
        "gradient_bytes_measured": report.gradient_bytes_measured,
        "gradient_bytes_formula": report.gradient_bytes_formula,
        "other_bytes_measured": report.other_bytes_measured,
    }


def _print(rows):
    header = ["config", "steps/s", "bytes/step measured", "formula", "max device bytes"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        values = [r["config"], f"{r['steps_per_s']:.2f}", f"{r['bytes_measured']:,}"]
        values += [f"{r['bytes_formula']:,}", f"{r['max_device_bytes']:,}"]
        print("| " + " | ".join(values) + " |")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from tfscale import strategies

    strategies.split_cpu(NUM_DEVICES)  # Before TensorFlow starts.
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype("float32")
    y = rng.integers(0, 10, size=(args.batch,))
    rows = []
    for config, (stages, replicas, microbatches) in CONFIGS.items():
        strategy = strategies.PipelineStrategy(
            num_stages=stages, num_microbatches=microbatches, data_parallel=replicas, balance="uniform"
        )
        model = strategy.split(_model(keras, args.width, args.layers))
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        report = model.plan_report(x, y)
        rows.append(_row(config, _steps_per_second(model, x, y, args.steps, args.repeats), report))
    _print(rows)
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/hybrid.json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
