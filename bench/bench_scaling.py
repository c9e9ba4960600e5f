"""Scaling report: throughput, efficiency and all-reduce share on 1, 2, 4 replicas and workers.

The same model and per-replica batch run under `mirrored` with 1, 2, 4 logical CPU
replicas (one process each) and under `multi_worker` with 1, 2, 4 processes on loopback
(`tfscale.launch.run_local_cluster`, one CPU replica each), each with and without fp16
gradient compression and with gradient accumulation k=1 and k=4: the four variants
train one after the other in the same process(es). Each variant's numbers come from
`tfscale.callbacks.CommunicationProfiler` (worker 0's report): step time (wall clock of
the profiled steps), all-reduce fraction and launches per step (these also count the
loss's own launch, its sum and denominators, `tfscale.compat.keras_loss_denominator`, and
under `multi_worker` the loss/metric all-reduce tfscale's multi-worker fix adds) and bytes
per step (the gradients' size in the all-reduce dtype over k; see the callback).
Efficiency is T1 / (N x TN), T the
time per example: examples_per_s(N) / (N x examples_per_s(1)) within one
mode/compression/accumulation group.

On a 2-core machine N processes or replicas share 2 cores: the absolute speed-up is
not the point; bytes, launches and the all-reduce fraction are.

Run: python bench/bench_scaling.py [--quick]
Writes bench/results/scaling.json and bench/results/scaling.png.
"""

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

VARIANTS = [(None, 1), ("fp16", 1), (None, 4), ("fp16", 4)]
COUNTS = (1, 2, 4)
PER_REPLICA_BATCH = 32
WIDTH = 256


def _model(keras, accumulation):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    optimizer = keras.optimizers.SGD(
        0.01, gradient_accumulation_steps=accumulation if accumulation > 1 else None
    )
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def run_variants(strategy, steps, log_dir):
    """In one process: every variant under `strategy`; worker-0-style report per variant."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfscale.callbacks
    import tfscale.strategies

    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * global_batch, 64)).astype("float32")
    y = rng.integers(0, 10, size=(steps * global_batch,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch).repeat()
    results = []
    for compression, accumulation in VARIANTS:
        tfscale.strategies.configure_communication(strategy, gradient_compression=compression)
        with strategy.scope():
            model = _model(keras, accumulation)
        # Steps 1-4 trace and warm up; a multiple of 4 profiled steps holds whole k=4 cycles.
        first = 5
        profiler = tfscale.callbacks.CommunicationProfiler(
            os.path.join(log_dir, f"{compression}-{accumulation}"), profile_steps=(first, steps)
        )
        model.fit(dataset, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[profiler])
        report = profiler.report
        launches = report["allreduce_launches_per_step"]
        results.append(
            {
                "compression": compression or "none",
                "accumulation": accumulation,
                "global_batch": global_batch,
                "step_s": report["step_s"],
                "examples_per_s": global_batch / report["step_s"],
                "allreduce_fraction": report["allreduce_fraction"],
                "allreduce_launches_per_step": launches,
                "allreduce_bytes_per_step": report["allreduce_bytes_per_step"],
            }
        )
    return results


def _mirrored_child(replicas, steps, log_dir):
    import tfscale.strategies

    # N=1 is one device (no all-reduce), the baseline of both modes: with one replica
    # Keras's own gradient accumulation crashes under mirrored/multi_worker (merge_call
    # inside its cond; tfscale's optimizer fix is gated on > 1 replica).
    strategy = tfscale.strategies.get("mirrored", cpu_replicas=replicas) if replicas > 1 else None
    strategy = strategy or tfscale.strategies.get("one_device")
    print(json.dumps(run_variants(strategy, steps, log_dir)))


def worker_task(steps, log_dir):
    """A `run_local_cluster` target: one task of the multi_worker run."""
    import tfscale.strategies

    return run_variants(tfscale.strategies.get("multi_worker"), steps, log_dir)


def _mirrored(replicas, steps, log_dir):
    code = f"import bench_scaling as b; b._mirrored_child({replicas}, {steps}, {log_dir!r})"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(os.path.abspath(__file__)),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _workers(count, steps, log_dir):
    from tfscale.launch import run_local_cluster

    if count == 1:
        return _mirrored(1, steps, log_dir)  # One worker, one replica: one device.

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_scaling  # The target must be importable by module name in each task.

    env = {"PYTHONPATH": os.path.dirname(os.path.abspath(__file__)), "TF_CPP_MIN_LOG_LEVEL": "2"}
    tasks = run_local_cluster(bench_scaling.worker_task, count, args=(steps, log_dir), env=env, timeout=600)
    return tasks[0].value


def _efficiency(rows):
    base = {
        (r["mode"], r["compression"], r["accumulation"]): r["examples_per_s"] for r in rows if r["n"] == 1
    }
    for r in rows:
        r["efficiency"] = r["examples_per_s"] / (
            r["n"] * base[(r["mode"], r["compression"], r["accumulation"])]
        )


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, style in (("replicas", "-"), ("workers", "--")):
        for compression, accumulation in VARIANTS:
            label = f"{mode}, {compression or 'fp32'}, k={accumulation}"
            group = [
                r
                for r in rows
                if r["mode"] == mode
                and r["compression"] == (compression or "none")
                and r["accumulation"] == accumulation
            ]
            ns = [r["n"] for r in group]
            left.plot(ns, [r["examples_per_s"] for r in group], style, marker="o", label=label)
            right.plot(ns, [r["efficiency"] for r in group], style, marker="o", label=label)
    left.set(xlabel="N", ylabel="examples/s", title="throughput", xticks=COUNTS)
    right.set(xlabel="N", ylabel="T1 / (N x TN)", title="efficiency", xticks=COUNTS, ylim=(0, 1.2))
    right.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--steps", type=int, default=24, help="steps per variant (4 warm-up, the rest profiled)"
    )
    parser.add_argument("--quick", action="store_true", help="12 steps per variant")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    steps = 12 if args.quick else args.steps
    if steps < 8 or steps % 4:
        parser.error(f"--steps={steps}: expected a multiple of 4, at least 8")
    os.makedirs(args.out, exist_ok=True)
    log_dir = os.path.join(args.out, "scaling_profiles")
    rows = []
    for mode, run in (("replicas", _mirrored), ("workers", _workers)):
        for n in COUNTS:
            for r in run(n, steps, os.path.join(log_dir, f"{mode}{n}")):
                rows.append(
                    {
                        "mode": mode,
                        "n": n,
                        "workers": n if mode == "workers" else 1,
                        "replicas": n,
                        **r,
                    }
                )
            print(f"done: {mode} N={n}", file=sys.stderr, flush=True)
    _efficiency(rows)
    with open(os.path.join(args.out, "scaling.json"), "w") as f:
        json.dump(rows, f, indent=1)
    _plot(rows, os.path.join(args.out, "scaling.png"))
    print(
        "| mode | N | compression | k | examples/s | efficiency | all-reduce | bytes/step | launches/step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        cells = [r["mode"], r["n"], r["compression"], r["accumulation"], f"{r['examples_per_s']:.0f}"]
        cells += [f"{r['efficiency']:.2f}", f"{100 * r['allreduce_fraction']:.0f}%"]
        cells += [f"{r['allreduce_bytes_per_step']:.0f}", f"{r['allreduce_launches_per_step']:.2f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
