"""On a machine with a GPU: run the paths no CPU test reaches, with each device's peak memory.

One command, a few minutes (budget: under 8). With one physical GPU, it is split into
`--logical_gpus` logical GPUs (`tf.config.set_logical_device_configuration`, each with
`--memory_mb`); with several, the first `--logical_gpus` physical ones are used. Rows:

- mirrored, `cross_device_ops="nccl"` over the GPUs, weights after a few SGD steps
  against plain Keras on one device;
- pipeline (`num_stages=2`, 1F1B, M=4) and model split (layer, and tensor split) over the
  GPUs, each against plain Keras on one device;
- bench_strategies' overhead ratio on the GPUs (paired rounds, tfscale's mirrored with
  NCCL vs a hand-built `tf.distribute.MirroredStrategy` with `NcclAllReduce`);
- multi_worker with `communication="nccl"`, 2 local processes, one GPU each (needs 2
  physical GPUs: NCCL refuses two ranks on one GPU, so with one it is skipped, saying so).

Prints one table: status, max |weight difference| against one device, seconds, and TF's
GPU allocator peak bytes per device (`tf.config.experimental.get_memory_info(...)["peak"]`,
reset before each row). Without a GPU it prints one line and exits 0. Exits 1 if a row failed.

    python bench/device_proof.py [--logical_gpus 2] [--memory_mb 4096] [--steps 20]

Writes `bench/results/device_proof.json`.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

TOLERANCE = 1e-4  # fp32 with TF32 off; NCCL sums in another order than one device's batch mean
WIDTH = 256


def _model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def _data(steps, batch):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * batch, 64)).astype("float32")
    y = rng.integers(0, 10, size=(steps * batch,)).astype("int32")
    return x, y


def _train(model, x, y, batch):
    import keras

    model.compile(keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
    return model.get_weights()


def _max_diff(weights, reference):
    import numpy as np

    if len(weights) != len(reference):
        return float("inf")
    return max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))


def _peaks(tf, devices):
    return {d: tf.config.experimental.get_memory_info(d)["peak"] for d in devices}


def _reset(tf, devices):
    for d in devices:
        tf.config.experimental.reset_memory_stats(d)


def _rows_in_process(args, tf, gpus):
    """Every row that runs in this process: (label, callable returning (check, note))."""
    import _paired
    import bench_strategies
    import keras

    import tfscale.strategies

    kind = "cpu" if args.dry_run_on_cpu else "gpu"
    nccl = None if args.dry_run_on_cpu else "nccl"
    x, y = _data(args.steps, args.batch)
    with tf.device(f"/{kind}:0"):
        reference = _train(_model(keras), x, y, args.batch)
    devices = [f"/{kind}:{i}" for i in range(args.logical_gpus)]

    def mirrored():
        strategy = tfscale.strategies.get("mirrored", devices=devices, cross_device_ops=nccl)
        with strategy.scope():
            model = _model(keras)
            weights = _train(model, x, y, args.batch)
        return _max_diff(weights, reference), f"{strategy.num_replicas_in_sync} replicas"

    def pipeline():
        strategy = tfscale.strategies.get(
            "pipeline", num_stages=args.logical_gpus, num_microbatches=4, schedule="1f1b", devices=devices
        )
        split = strategy.split(_model(keras))
        return _max_diff(_train(split, x, y, args.batch), reference), f"S={args.logical_gpus} M=4 1f1b"

    def model_split(tensor):
        def run():
            options = {"tensor_parallel": True} if tensor else {}
            strategy = tfscale.strategies.get("model_split", devices=devices, **options)
            split = strategy.split(_model(keras))
            _train(split, x, y, args.batch)
            merged = strategy.merge(split).get_weights()  # the original layout, comparable
            return _max_diff(merged, reference), "tensor" if tensor else "layer"

        return run

    def overhead():
        steps, batch = 200, 256  # bench_strategies' defaults
        big_x, big_y = _data(steps, batch)
        dataset = tf.data.Dataset.from_tensor_slices((big_x, big_y)).batch(batch).cache().prefetch(2)
        ours = tfscale.strategies.get("mirrored", devices=devices, cross_device_ops=nccl)
        ops = tf.distribute.NcclAllReduce() if nccl else None
        hand_built = tf.distribute.MirroredStrategy(devices, cross_device_ops=ops)
        summary = bench_strategies.overhead_ratio(
            ours, hand_built, dataset, steps=steps, rounds=args.rounds, width=WIDTH
        )
        ratio = summary["variants"]["tfscale"]["ratio"]
        control = summary["variants"][_paired.CONTROL]["ratio"]
        note = (
            f"ratio {ratio['median']:.3f} [{ratio['min']:.3f}, {ratio['max']:.3f}], "
            f"A/A {control['median']:.3f} [{control['min']:.3f}, {control['max']:.3f}]"
        )
        return None, note

    return [
        ("mirrored nccl", mirrored),
        ("pipeline", pipeline),
        ("model_split layer", model_split(False)),
        ("model_split tensor", model_split(True)),
        ("overhead ratio", overhead),
    ]


def worker_task(steps, batch):
    """A `run_local_cluster` target: one GPU per task, multi_worker with NCCL."""
    import tensorflow as tf

    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    gpus = tf.config.list_physical_devices("GPU")
    tf.config.set_visible_devices(gpus[index], "GPU")  # before the runtime starts
    tf.config.experimental.set_memory_growth(gpus[index], True)
    tf.config.experimental.enable_tensor_float_32_execution(False)
    import keras

    import tfscale.strategies

    strategy = tfscale.strategies.get("multi_worker", communication="nccl")
    x, y = _data(steps, batch)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)
    with strategy.scope():
        model = _model(keras)
        model.compile(
            keras.optimizers.SGD(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
    model.fit(dataset, epochs=1, verbose=0)
    return {
        "weights": model.get_weights(),
        "peak": tf.config.experimental.get_memory_info("GPU:0")["peak"],
        "replicas": strategy.num_replicas_in_sync,
    }


def _multi_worker(args, physical):
    if physical < 2:
        return (
            "skipped",
            None,
            f"needs 2 physical GPUs ({physical} here): NCCL refuses 2 ranks on one GPU",
            {},
        )
    import device_proof

    from tfscale.launch import run_local_cluster

    env = {"PYTHONPATH": HERE, "TF_CPP_MIN_LOG_LEVEL": "2"}
    tasks = run_local_cluster(
        device_proof.worker_task, 2, args=(args.steps, args.batch), env=env, timeout=240
    )
    first, second = (t.value for t in tasks)
    diff = _max_diff(first["weights"], second["weights"])
    peaks = {f"worker {i} GPU:0": t.value["peak"] for i, t in enumerate(tasks)}
    return "ok", diff, f"{first['replicas']} replicas, max diff between workers", peaks


def _table(rows, devices):
    head = f"{'path':<20} {'status':<8} {'max |dw|':>9} {'s':>6} " + " ".join(
        f"{'peak MB ' + d:>14}" for d in devices
    )
    lines = [head]
    for r in rows:
        peaks = " ".join(
            f"{r['peaks'][d] / 2**20:>14.1f}" if d in r["peaks"] else f"{'-':>14}" for d in devices
        )
        diff = "-" if r["check"] is None else f"{r['check']:.1e}"
        lines.append(f"{r['path']:<20} {r['status']:<8} {diff:>9} {r['seconds']:>6.1f} {peaks}  {r['note']}")
        for d, b in r["peaks"].items():
            if d not in devices:
                lines[-1] += f" {d}: {b / 2**20:.1f} MB"
    return "\n".join(lines)


def _dry_run_on_cpu(args, tf):
    import tfscale.strategies

    tfscale.strategies.split_cpu(args.logical_gpus)
    rows = []
    for path, run in _rows_in_process(args, tf, []):
        start = time.monotonic()
        check, note = run()
        status = "ok" if check is None or check <= TOLERANCE else "DIFFERS"
        rows.append(
            {
                "path": path,
                "status": status,
                "check": check,
                "seconds": time.monotonic() - start,
                "peaks": {},
                "note": note,
            }
        )
    print(_table(rows, []))
    return 1 if any(r["status"] != "ok" for r in rows) else 0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logical_gpus", type=int, default=2)
    parser.add_argument("--memory_mb", type=int, default=4096, help="each logical GPU, when one is split")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="paired rounds of the overhead ratio")
    parser.add_argument(
        "--dry_run_on_cpu",
        action="store_true",
        help="check this script's own code on logical CPUs (no NCCL, no GPU memory, no multi_worker)",
    )
    args = parser.parse_args(argv)

    import tensorflow as tf

    if args.dry_run_on_cpu:
        return _dry_run_on_cpu(args, tf)
    physical = tf.config.list_physical_devices("GPU")  # does not start the runtime
    if not physical:
        print(
            "device_proof: no GPU visible here (tf.config.list_physical_devices('GPU') is empty), nothing run"
        )
        return 0
    if len(physical) == 1:
        config = tf.config.LogicalDeviceConfiguration(memory_limit=args.memory_mb)
        tf.config.set_logical_device_configuration(physical[0], [config] * args.logical_gpus)
    else:
        # Else this process would take all memory of every GPU and the multi_worker tasks none.
        for gpu in physical:
            tf.config.experimental.set_memory_growth(gpu, True)
        args.logical_gpus = min(args.logical_gpus, len(physical))
    tf.config.experimental.enable_tensor_float_32_execution(False)  # fp32 comparisons with one device
    names = [f"GPU:{i}" for i in range(args.logical_gpus)]
    print(
        f"device_proof: {len(physical)} physical GPU(s) "
        f"({tf.config.experimental.get_device_details(physical[0]).get('device_name', '?')}), "
        f"{args.logical_gpus} GPUs used, TF {tf.__version__}"
    )
    started, rows = time.monotonic(), []
    for path, run in _rows_in_process(args, tf, physical):
        _reset(tf, names)
        start = time.monotonic()
        try:
            check, note = run()
            status = "ok" if check is None or check <= TOLERANCE else "DIFFERS"
        except Exception as e:  # one row's failure is reported, the others still run
            check, status = None, "FAILED"
            note = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
        rows.append(
            {
                "path": path,
                "status": status,
                "check": check,
                "seconds": time.monotonic() - start,
                "peaks": _peaks(tf, names),
                "note": note,
            }
        )
    start = time.monotonic()
    try:
        status, check, note, peaks = _multi_worker(args, len(physical))
        if status == "ok" and check > TOLERANCE:
            status = "DIFFERS"
    except Exception as e:
        status, check, peaks = "FAILED", None, {}
        note = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"
    rows.append(
        {
            "path": "multi_worker nccl",
            "status": status,
            "check": check,
            "seconds": time.monotonic() - start,
            "peaks": peaks,
            "note": note,
        }
    )
    print(_table(rows, names))
    print(
        f"max |dw|: largest weight difference against plain Keras on one GPU (tolerance {TOLERANCE}); "
        f"peak MB: TF's GPU allocator peak during the row; total {time.monotonic() - started:.0f} s"
    )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "device_proof.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 1 if any(r["status"] in ("FAILED", "DIFFERS") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
