"""Input pipeline throughput: `tfscale.datasets.load` vs a naive `from_tensor_slices().batch()`.

Both pipelines serve the same examples (the bundled digits' train split, or the same
synthetic images) as float32 batches. Each is consumed inside a `tf.function`
(`Dataset.reduce`), so Python's per-batch overhead is not measured: "drain" only counts
the examples (pure pipeline speed, where `load`'s prefetch thread is pure overhead);
"step" runs a model-like step per batch (a dense layer to 256 units, then
`--step_layers` 256x256 tanh layers), where prefetch overlaps input and compute.
`--epochs` epochs per timing, after a warm-up; the pipelines are timed in turn, in rotating order,
and the medians compared. Also shown: the naive pipeline with the same shuffle as
`load`, and `load`'s cold start ("cold": the `load` call, which reads and decodes a small
split into memory, plus the first epoch; the TFDS dataset is prepared before any timing).
Goal: with a step, `load` (shuffled, in memory, prefetched) at least as fast as the naive
pipeline with the same shuffle (ratio "vs shuf" >= 1.0).

Run: python bench/bench_datasets.py [--repeats 9] [--epochs 20] [--data_dir DIR]
Writes bench/results/datasets.json.
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _drain_fn(tf, ds, step_layers):
    """Consumes `ds` in one tf.function; with `step_layers`, a model-like step per batch."""
    if step_layers:
        features = int(np.prod(ds.element_spec[0].shape[1:]))
        rng = np.random.default_rng(0)
        first = tf.constant(rng.normal(size=(features, 256)).astype("float32") / features**0.5)
        hidden = tf.constant(rng.normal(size=(256, 256)).astype("float32") / 16.0)

    def body(n, batch):
        count = n + tf.cast(tf.shape(batch[1])[0], tf.int64)
        if not step_layers:
            return count
        h = tf.matmul(tf.reshape(tf.cast(batch[0], tf.float32), [tf.shape(batch[0])[0], -1]), first)
        for _ in range(step_layers):
            h = tf.tanh(tf.matmul(h, hidden))
        return count + tf.cast(tf.reduce_sum(h) * 0.0, tf.int64)  # keeps the step from being pruned

    @tf.function
    def drain():
        return ds.reduce(tf.constant(0, tf.int64), body)

    return drain


def _time(drain):
    start = time.perf_counter()
    examples = int(drain())
    return examples / (time.perf_counter() - start)


def _workloads(args, tf, np):
    import tfscale.datasets
    from tfscale.datasets import digits, synthetic

    digits.prepare(args.data_dir)  # once, before any timing
    pixels, labels = digits.read_csv()
    x = (pixels[: digits.TRAIN_EXAMPLES] / 255.0).astype("float32")
    y = labels[: digits.TRAIN_EXAMPLES]
    yield (
        "digits",
        args.batch,
        x,
        y,
        lambda: tfscale.datasets.load("digits", "train", args.batch, data_dir=args.data_dir),
    )
    name = f"synthetic:images/32x32x3/10/{args.synthetic_examples}"
    data = synthetic.generate(synthetic.parse(name))
    yield (
        name,
        args.batch,
        data["image"],
        data["label"],
        lambda: tfscale.datasets.load(name, "train", args.batch),
    )


def _measure(args, tf, workload, step_layers):
    name, batch, x, y, make_load = workload
    naive = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True)
    naive_shuffled = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shuffle(len(x), seed=0, reshuffle_each_iteration=True)
        .batch(batch, drop_remainder=True)
    )
    start = time.perf_counter()
    loaded = make_load()
    cold = int(_drain_fn(tf, loaded, 0)()) / (time.perf_counter() - start)
    drains = {
        "naive": _drain_fn(tf, naive.repeat(args.epochs), step_layers),
        "naive+shuffle": _drain_fn(tf, naive_shuffled.repeat(args.epochs), step_layers),
        "tfscale.load": _drain_fn(tf, loaded.repeat(args.epochs), step_layers),
    }
    for drain in drains.values():
        drain()  # warm-up: tracing
    rates = {k: [] for k in drains}
    keys = list(drains)
    for i in range(args.repeats):
        for key in keys[i % 3 :] + keys[: i % 3]:  # rotate, so no pipeline always runs first
            rates[key].append(_time(drains[key]))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {
        "dataset": name,
        "consumer": f"step({step_layers} layers)" if step_layers else "drain",
        "batch": batch,
        "examples": len(x),
        "examples_per_sec": medians,
        "load_cold_examples_per_sec": cold,
        "ratio_load_vs_naive": medians["tfscale.load"] / medians["naive"],
        "ratio_load_vs_naive_shuffled": medians["tfscale.load"] / medians["naive+shuffle"],
        "samples": rates,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--synthetic_examples", type=int, default=4096)
    parser.add_argument("--step_layers", type=int, default=4, help="256-wide layers of the model-like step")
    parser.add_argument("--data_dir", default=None, help="where digits is prepared (default: a temp dir)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "datasets.json"))
    args = parser.parse_args()
    args.data_dir = args.data_dir or tempfile.mkdtemp(prefix="tfscale-bench-tfds-")

    import tensorflow as tf

    rows = [
        _measure(args, tf, w, layers) for w in _workloads(args, tf, np) for layers in (0, args.step_layers)
    ]
    print(
        f"{'dataset':34} {'consumer':16} {'batch':>5} {'naive':>9} {'naive+shuf':>10} {'load':>9} "
        f"{'ratio':>6} {'vs shuf':>7} {'cold':>7}"
    )
    for r in rows:
        m = r["examples_per_sec"]
        print(
            f"{r['dataset']:34} {r['consumer']:16} {r['batch']:5d} {m['naive']:9.0f} "
            f"{m['naive+shuffle']:10.0f} {m['tfscale.load']:9.0f} {r['ratio_load_vs_naive']:6.2f} "
            f"{r['ratio_load_vs_naive_shuffled']:7.2f} {r['load_cold_examples_per_sec']:7.0f}"
        )
    print(f"examples/s, medians of {args.repeats} rotating timings of {args.epochs} epochs each")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
