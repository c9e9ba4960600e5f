"""Pipeline x data parallel: DP4, PP4 and DP2 x PP2 on 4 logical CPU devices, and on 2 processes.

One MLP (`--layers` Dense layers `--width` wide) and one global batch for every config:

- DP4: 4 copies of the whole model (a 1-stage pipeline, `data_parallel=4`), M = 1;
- PP4: a 4-stage 1F1B pipeline, M = 8;
- DP2 x PP2: 2 copies of a 2-stage 1F1B pipeline, M = 4 per copy (same micro-batch as PP4);
- 2 processes x 2 devices: DP2 x PP2 (M = 4) on a real 2-task cluster on loopback, copy d
  on task d's 2 logical CPUs (a pipeline inside each process, data parallel across them);
- PP2 on 2 processes: a 2-stage pipeline (M = 8), stage s on task s (one stage per process).

Each config reports steps/s (median of `--repeats` timings of `--steps` `train_on_batch`
calls) and its `PipelinedModel.plan_report`: bytes sent between devices per step, counted
from the traced step (activations + gradients) beside the formula, and the most bytes one
device holds (parameters + Adam slots + the activations alive at the peak of a profiled
step). DP4 uses the same all-reduce (`strategies._replicas`) as the hybrid, so the three
differ only in shape.

The 2-process rows run in a cluster started by `tfscale.launch.run_local_cluster` (free
ports, every task killed after `--cluster_timeout`): worker 0 connects
(`connect_cluster`) and trains, worker 1 serves its devices. Their `bytes_measured` is
what crossed between the processes: the bytes sent on the tasks' TCP connections during
the timed steps, read from the kernel with `ss` (as `tests/_hybrid_cluster_workers.py`
does), per step; `bytes_formula` is the tensors that must cross: PP2, each micro-batch's
cut activation forward and its gradient back (2 x a x M) and the labels to the last stage;
2 x 2, each stage's packed gradients both ways (2 x parameters) and copy 1's half of the
batch. The difference is gRPC framing and the client's per-step calls. Their
`max_device_bytes` and formula terms come from the `plan_report` of the same shape on this
process's logical CPUs (TensorFlow's profiler does not see ops run on another task); its
split of the bytes between devices is kept in the JSON as `device_*`.

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
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
NUM_DEVICES = 4
# config -> (num_stages, data_parallel, num_microbatches)
CONFIGS = {"DP4": (1, 4, 1), "PP4 (M=8)": (4, 1, 8), "DP2 x PP2 (M=4)": (2, 2, 4)}
# config -> (num_stages, data_parallel, num_microbatches, logical CPUs per task)
CLUSTER_CONFIGS = {
    "2 processes x 2 devices: DP2 x PP2 (M=4)": (2, 2, 4, 2),
    "PP2 (M=8), stage s on process s": (2, 1, 8, 1),
}
_TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")


def _model(keras, width, layers):
    keras.utils.set_random_seed(0)
    dense = [keras.layers.Dense(width, activation="relu") for _ in range(layers - 1)]
    return keras.Sequential([keras.Input((width,)), *dense, keras.layers.Dense(10)])


def _data(args):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args["batch"], args["width"])).astype("float32")
    return x, rng.integers(0, 10, size=(args["batch"],))


def _compiled(keras, strategy, args):
    model = strategy.split(_model(keras, args["width"], args["layers"]))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


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


def cluster_task(config, args):
    """One task of a 2-process config: worker 0 trains and returns `(steps/s, bytes sent
    between the tasks per step)`, worker 1 serves its devices and returns None once
    worker 0 has gone."""
    sys.path.insert(0, _TESTS)
    import _hybrid_cluster_workers as workers  # The tests' connect and `ss` byte counter.

    stages, replicas, microbatches, cpus = CLUSTER_CONFIGS[config]
    if not workers._connect(cpus):
        return None
    import keras

    from tfscale import strategies

    options = {"num_stages": stages, "num_microbatches": microbatches, "balance": "uniform"}
    if replicas == 1:  # One stage per task, named.
        options["devices"] = [f"/job:worker/replica:0/task:{t}/device:CPU:0" for t in range(stages)]
    else:  # As on one host: the cluster's devices task by task, so copy d on task d.
        options["data_parallel"] = replicas
    model = _compiled(keras, strategies.PipelineStrategy(**options), args)
    x, y = _data(args)
    # The first step sends the traced functions to task 1 (once per run, not per step).
    model.train_on_batch(x, y)
    ports = workers._cluster_ports()
    before = workers._bytes_between_tasks(ports)
    rate = _steps_per_second(model, x, y, args["steps"], args["repeats"])
    # Every step run since `before`: the one `_steps_per_second` starts with, and the timed ones.
    return rate, (workers._bytes_between_tasks(ports) - before) / (1 + args["steps"] * args["repeats"])


def _cluster_row(config, measured, report, x, y):
    """The table's columns between the processes (`measured`: steps/s, bytes sent between
    the tasks per step); the report's split (between the devices, any task) beside them."""
    rate, sent = measured
    split = _row(config, rate, report).items()
    return {
        "config": config,
        "steps_per_s": round(rate, 3),
        "bytes_measured": round(sent),
        "bytes_formula": _between_tasks_formula(report, x, y),
        "max_device_bytes": report.max_device_bytes,
        **{f"device_{k}": v for k, v in split if k.endswith(("_measured", "_formula"))},
    }


def _between_tasks_formula(report, x, y):
    """The bytes of the tensors that must cross between the two tasks per step."""
    if report.data_parallel == 1:
        # Every cut is between the tasks; the labels go to the last stage (task 1).
        return report.activation_bytes_formula + y.nbytes
    # Copy 0 on task 0, copy 1 on task 1: each stage's packed gradients both ways, and copy
    # 1's slice of the batch; the activations between a copy's stages stay in its task.
    return 2 * sum(report.stage_gradient_bytes) + (x.nbytes + y.nbytes) // report.data_parallel


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
    parser.add_argument("--cluster_timeout", type=float, default=180.0, help="seconds per 2-process config")
    args = parser.parse_args()
    sizes = {k: getattr(args, k) for k in ("width", "layers", "batch", "steps", "repeats")}

    from tfscale import strategies

    strategies.split_cpu(NUM_DEVICES)  # Before TensorFlow starts.
    import keras

    x, y = _data(sizes)
    rows = []
    for config, (stages, replicas, microbatches) in CONFIGS.items():
        strategy = strategies.PipelineStrategy(
            num_stages=stages, num_microbatches=microbatches, data_parallel=replicas, balance="uniform"
        )
        model = _compiled(keras, strategy, sizes)
        report = model.plan_report(x, y)
        rows.append(_row(config, _steps_per_second(model, x, y, args.steps, args.repeats), report))

    from tfscale.launch import run_local_cluster

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_hybrid  # By name: a task cannot import `__main__`.

    for config, (stages, replicas, microbatches, _) in CLUSTER_CONFIGS.items():
        # The plan (memory per device, formulas) of the same shape on this process's
        # logical CPUs: TensorFlow's profiler does not see the ops run on another task.
        strategy = strategies.PipelineStrategy(
            num_stages=stages, num_microbatches=microbatches, data_parallel=replicas, balance="uniform"
        )
        report = _compiled(keras, strategy, sizes).plan_report(x, y)
        results = run_local_cluster(
            bench_hybrid.cluster_task,
            2,
            args=(config, sizes),
            timeout=args.cluster_timeout,
            env={"TF_CPP_MIN_LOG_LEVEL": "2"},
        )
        rows.append(_cluster_row(config, results[0].value, report, x, y))
    _print(rows)
    os.makedirs("bench/results", exist_ok=True)
    with open("bench/results/hybrid.json", "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
