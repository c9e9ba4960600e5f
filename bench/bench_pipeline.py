"""Pipeline parallelism on 2 logical CPU devices, one core each: steps/s and measured bubble.

Compares, on the same MLP and the same batches (by default 8 hidden Dense(512, tanh) layers
and a Dense(10) output, split by parameter count into 4 | 4 + output: two stages of equal
work, as the theory (S - 1) / (M + S - 1) assumes; with 7 hidden layers the best split is
4 | 3 + output and the M=8 speed-up is capped near 1.6x however fast the kernels):
- one device: the plain Keras model, `fit` on one logical CPU device (TensorFlow may still
  run two independent ops at once, i.e. use both cores);
- one core: the same model as a 1-stage pipeline, its ops run one at a time;
- naive split: the model cut into 2 stages, one batch at a time (pipeline with M=1);
- pipeline: GPipe and 1F1B with M = 1, 2, 4, 8 micro-batches; interleaved 1F1B (V = 2
  chunks per device, the model cut into 4 chunks of 2 layers), ZB-H1 (B and W split) and
  ZB-V (B and W split, 2 chunks per device in a V: device 0 holds the first and the last)
  with M = 4, 8;
- "free" rows: the same without `serialize_stages`, i.e. a stage may use both cores.

`--set new` runs only the side-by-side comparison of the new schedules: one device, the
naive split, and 1F1B, interleaved, ZB-H1 and ZB-V at M=8 (about a minute on a quiet machine).

TensorFlow runs each op on one thread (`intra_op` = 1) and up to 2 ops at once (`inter_op`
= 2); with `serialize_stages` (the default on CPU) each stage runs one op at a time, so
each stage gets one core and overlap between stages is the only source of speed-up. The
bubble is measured on a profiled step (`PipelinedModel.trace_step`, the shortest of
`--repeats`) and compared with the schedule's theory for equal op times
(`schedules.theoretical_bubble`: (S - 1) / (M + S - 1) for GPipe and 1F1B,
(S - 1) / (V M + S - 1) interleaved, (S - 1) / (3 M + S - 1) ZB-H1, (S - 1) / (6 M + S - 1)
ZB-V once 2 M >= 3 S - 1).
Prints a table, writes `bench/results/pipeline.json` (with the load average) and the Gantt
charts `bench/results/pipeline_timeline_{schedule}_m{M}.png`.

    python bench/bench_pipeline.py [--set full|new] [--steps 10] [--repeats 3] [--width 512]
        [--layers 9] [--batch 2048]
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


def _dataset(args):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch * 4, args.width)).astype("float32")
    y = rng.normal(size=(args.batch * 4, 10)).astype("float32")
    return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch, drop_remainder=True).repeat()


def _configs(which):
    yield "one device", None, {}
    if which == "new":
        yield "naive split", "1f1b", {"num_microbatches": 1}
        yield "pipeline", "1f1b", {"num_microbatches": 8}
        yield "pipeline", "interleaved", {"num_microbatches": 8, "virtual_stages": 2}
        yield "pipeline", "zb-h1", {"num_microbatches": 8}
        yield "pipeline", "zb-v", {"num_microbatches": 8, "virtual_stages": 2}
        return
    yield "one core", "1f1b", {"num_stages": 1, "num_microbatches": 1, "serialize_stages": True}
    yield "naive split free", "1f1b", {"num_microbatches": 1, "serialize_stages": False}
    yield "pipeline free", "1f1b", {"num_microbatches": 8, "serialize_stages": False}
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 2, 4, 8):
            yield ("naive split" if m == 1 else "pipeline"), schedule, {"num_microbatches": m}
    for m in (4, 8):
        yield "pipeline", "interleaved", {"num_microbatches": m, "virtual_stages": 2}
        yield "pipeline", "zb-h1", {"num_microbatches": m}
        yield "pipeline", "zb-v", {"num_microbatches": m, "virtual_stages": 2}


def _build(name, schedule, options, args, data):
    import keras

    from tfscale.strategies import PipelineStrategy

    model = _model(args.width, args.layers)
    row = {"run": name, "schedule": schedule or "-", "M": options.get("num_microbatches", "-")}
    row["V"] = options.get("virtual_stages", 1 if schedule else "-")
    if schedule is not None:
        options = {"num_stages": 2, "schedule": schedule, "balance": "parameters", **options}
        model = PipelineStrategy(**options).split(model)
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=False)
    model.fit(data, epochs=1, steps_per_epoch=2, verbose=0)  # Traces the graph.
    return model, row


def _steps_per_second(model, data, steps):
    start = time.perf_counter()
    model.fit(data, epochs=1, steps_per_epoch=steps, verbose=0)
    return steps / (time.perf_counter() - start)


def _measure(runs, data, args):
    # Round robin, best of `repeats`: the other processes on a shared machine only ever slow
    # a run down, and interleaving spreads their load over all configurations alike.
    for _ in range(args.repeats):
        for model, row in runs:
            rate = _steps_per_second(model, data, args.steps)
            row["steps_per_s"] = max(row.get("steps_per_s", 0.0), rate)


def _trace(model, row, x, y, args):
    from tfscale.strategies.pipeline import plot_timeline

    if row["schedule"] == "-":
        return
    # Best of `repeats` profiled steps, as for the speed: other processes only add gaps.
    traces = [model.trace_step(x[: args.batch], y[: args.batch]) for _ in range(args.repeats)]
    trace = min(traces, key=lambda t: t.makespan)
    row.update(_where_the_time_goes(trace))
    row.update(
        bubble=trace.bubble,
        bubble_theory=trace.theoretical_bubble,
        live=trace.live_activations,
        live_bound=trace.activation_bound,
    )
    if row["run"] in ("naive split", "pipeline"):
        plot_timeline(trace, RESULTS / f"pipeline_timeline_{row['schedule']}_m{row['M']}.png")


def _where_the_time_goes(trace):
    """Mean op time per kind, and the bubble the schedule would have with measured op times.

    Two replays of the schedule's order in `schedules.simulate`: `bubble_replayed` with each
    op taking its kind's mean measured time (the schedule's own idle for these kernels), and
    `bubble_replayed_ops` with each op taking its own measured duration (adds the idle from
    uneven ops: one stage's ops slower than the other's, one micro-batch slower than the
    next). What is left of the measured bubble beyond the second is time a device waited
    with its data ready: launch gaps between ops, transfers, other processes.
    """
    from tfscale.strategies.pipeline import schedules
    from tfscale.strategies.pipeline.schedules import Kind

    durations = {}
    for op, (start, end) in trace.intervals.items():
        durations.setdefault(schedules.Kind(op.kind), []).append(end - start)
    costs = {kind: float(np.mean(durations.get(kind, [0.0]))) for kind in schedules.Kind}
    v = trace.virtual_stages
    orders = schedules.order(trace.schedule, trace.num_stages, trace.num_microbatches, v)
    replay = schedules.simulate(orders, costs, v)
    chunks = {op.stage for lane in orders for op in lane}
    device = {c: schedules.chunk_device(c, trace.num_stages, trace.schedule) for c in chunks}
    spans = [(device[op.stage], a, b) for op, (a, b) in replay.items()]
    measured = {op: end - start for op, (start, end) in trace.intervals.items()}
    replay_ops = schedules.simulate(orders, {**costs, **measured}, v)
    spans_ops = [(device[op.stage], a, b) for op, (a, b) in replay_ops.items()]
    per_stage = {}
    for op, (start, end) in trace.intervals.items():
        per_stage.setdefault(f"{device[op.stage]}{Kind(op.kind).value}", []).append(end - start)
    return {
        "op_ms_per_device": {key: round(float(np.mean(d)) * 1e3, 1) for key, d in sorted(per_stage.items())},
        "op_ms": {kind.value: round(costs[kind] * 1e3, 1) for kind in schedules.Kind if kind in durations},
        "makespan_ms": round(trace.makespan * 1e3, 1),
        "bubble_replayed": schedules.bubble_fraction(spans, trace.num_stages),
        "bubble_replayed_ops": schedules.bubble_fraction(spans_ops, trace.num_stages),
    }


def _print(rows):
    by_run = {(r["run"], r["schedule"]): r["steps_per_s"] for r in rows}
    single, naive = by_run[("one device", "-")], by_run[("naive split", "1f1b")]
    print(
        f"{'run':<17} {'schedule':<11} {'M':>2} {'V':>2} {'steps/s':>8} {'x one-dev':>9} {'x naive':>8} "
        f"{'bubble':>7} {'theory':>7} {'replay':>7} {'rp-ops':>7} live (bound)  mean op ms"
    )
    for row in rows:
        row["speedup_vs_one_device"] = row["steps_per_s"] / single
        row["speedup_vs_naive_split"] = row["steps_per_s"] / naive
        bubble = f"{row['bubble']:.2f}" if "bubble" in row else "-"
        theory = f"{row['bubble_theory']:.2f}" if "bubble" in row else "-"
        replay = f"{row['bubble_replayed']:.2f}" if "bubble" in row else "-"
        replay_ops = f"{row['bubble_replayed_ops']:.2f}" if "bubble" in row else "-"
        print(
            f"{row['run']:<17} {row['schedule']:<11} {row['M']!s:>2} {row['V']!s:>2} "
            f"{row['steps_per_s']:8.2f} {row['speedup_vs_one_device']:9.2f} "
            f"{row['speedup_vs_naive_split']:8.2f} {bubble:>7} {theory:>7} {replay:>7} {replay_ops:>7} "
            f"{row.get('live', '-')} ({row.get('live_bound', '-')})  {row.get('op_ms', '-')}"
        )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--set", choices=["full", "new"], default="full", dest="which")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=9, help="Dense layers, the output included")
    parser.add_argument("--batch", type=int, default=2048)
    args = parser.parse_args(argv)
    _configure()
    x, y, data = _dataset(args)
    RESULTS.mkdir(parents=True, exist_ok=True)
    runs = [_build(name, schedule, options, args, data) for name, schedule, options in _configs(args.which)]
    _measure(runs, data, args)
    for model, row in runs:
        _trace(model, row, x, y, args)
    rows = [row for _, row in runs]
    print(f"load average at the end (1, 5, 15 min): {os.getloadavg()}")
    _print(rows)
    report = {"args": vars(args), "load_average": os.getloadavg(), "rows": rows}
    suffix = "" if args.which == "full" else f"_{args.which}"
    (RESULTS / f"pipeline{suffix}.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
