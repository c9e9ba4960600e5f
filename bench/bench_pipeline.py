"""Pipeline parallelism on 2 logical CPU devices, one core each: steps/s and measured bubble.

Compares, on the same MLP and the same batches:
- one device: the plain Keras model, `fit` on one logical CPU device;
- naive split: the model cut into 2 stages, one batch at a time (pipeline with M=1);
- pipeline: GPipe and 1F1B with M = 1, 2, 4, 8 micro-batches.

TensorFlow runs each op on one thread (`intra_op` = 1) and up to 2 ops at once (`inter_op`
= 2), so each stage gets one core and overlap is the only source of speed-up. The bubble
is measured on a profiled step (`PipelinedModel.trace_step`) and compared with the theory
(S - 1) / (M + S - 1). Prints a table, writes `bench/results/pipeline.json` and the Gantt
charts `bench/results/pipeline_timeline_{schedule}_m{M}.png`.

    python bench/bench_pipeline.py [--steps 20] [--width 512] [--layers 8] [--batch 256]
"""

import argparse
import json
import os
import pathlib
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _configure():
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    import tfscale.strategies

    tfscale.strategies.split_cpu(2)


def _model(width, depth, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    layers = [keras.Input((width,))]
    layers += [keras.layers.Dense(width, activation="tanh") for _ in range(depth - 1)]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def _steps_per_second(model, x, y, batch, steps):
    import keras

    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).cache()
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)  # traces the graph
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
        best = max(best, steps / (time.perf_counter() - start))
    return best


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=256)
    args = parser.parse_args(argv)
    _configure()
    from tfscale.strategies import PipelineStrategy
    from tfscale.strategies._timeline import plot

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * args.steps, args.width)).astype("float32")
    y = rng.normal(size=(args.batch * args.steps, 10)).astype("float32")
    RESULTS.mkdir(parents=True, exist_ok=True)
    rows = []
    with tf.device("/device:CPU:0"):
        single = _steps_per_second(_model(args.width, args.layers), x, y, args.batch, args.steps)
    rows.append({"run": "one device", "schedule": "-", "M": "-", "steps_per_s": single})
    naive = None
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 2, 4, 8):
            strategy = PipelineStrategy(
                num_stages=2, num_microbatches=m, schedule=schedule, balance="uniform"
            )
            pipelined = strategy.wrap(_model(args.width, args.layers))
            rate = _steps_per_second(pipelined, x, y, args.batch, args.steps)
            trace = pipelined.trace_step(x[: args.batch], y[: args.batch])
            plot(trace, RESULTS / f"pipeline_timeline_{schedule}_m{m}.png")
            naive = rate if (m == 1 and naive is None) else naive
            rows.append(
                {
                    "run": "naive split" if m == 1 else "pipeline",
                    "schedule": schedule,
                    "M": m,
                    "steps_per_s": rate,
                    "bubble": trace.bubble,
                    "bubble_theory": trace.theoretical_bubble,
                    "live_activations": trace.live_activations,
                }
            )
    print(
        f"{'run':<12} {'schedule':<8} {'M':>2} {'steps/s':>8} {'x one-dev':>9} {'x naive':>8} "
        f"{'bubble':>7} {'theory':>7} live"
    )
    for row in rows:
        row["speedup_vs_one_device"] = row["steps_per_s"] / single
        row["speedup_vs_naive_split"] = row["steps_per_s"] / naive
        bubble = f"{row['bubble']:.2f}" if "bubble" in row else "-"
        theory = f"{row['bubble_theory']:.2f}" if "bubble" in row else "-"
        print(
            f"{row['run']:<12} {row['schedule']:<8} {row['M']!s:>2} {row['steps_per_s']:8.2f} "
            f"{row['speedup_vs_one_device']:9.2f} {row['speedup_vs_naive_split']:8.2f} {bubble:>7} "
            f"{theory:>7} {row.get('live_activations', '-')}"
        )
    report = {"args": vars(args), "rows": rows}
    (RESULTS / "pipeline.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
