"""Reproducer for issue 28's profiler crash (not a test: too slow for the suite).

Runs N two-worker `tfscale-train --strategy=multi_worker --profile_steps=4:6` jobs (the
QUICK flags of tests/test_train.py's `multi_worker` fixture) one after another and counts
the runs in which a task did not exit 0, printing each failing task's exit and log tail
(the known crash: worker 1, abort (signal 6) with `free(): invalid pointer`, or signal 11,
at `tf.profiler.experimental.stop()`; cause in tfscale/compat/tf_traceme_split.py).

    nice -n 5 .venv/bin/python tests/_profiler_repro.py --runs 40

`--windows K` instead runs each job as K `fit` calls of a small model in each task, with
one `CommunicationProfiler` that profiles steps 2-3 of every `fit`: K profiler stops per
task per job, so a crash that hits one stop in ten shows within one or two jobs. Each
task prints how many of its K windows it traced.

    nice -n 5 .venv/bin/python tests/_profiler_repro.py --runs 3 --windows 20
"""

import argparse
import os
import sys
import tempfile
import time

from tfscale.datasets import digits
from tfscale.launch import run_local_cluster

QUICK = ("--epochs=3", "--global_batch_size=64", "--seed=0")


def windows_task(windows, log_dir):
    """A `run_local_cluster` target: `windows` fits of 4 steps, each profiled at steps 2-3."""
    import keras
    import numpy as np
    import tensorflow as tf

    import tfscale.callbacks
    import tfscale.strategies

    strategy = tfscale.strategies.get("multi_worker")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = rng.integers(0, 4, size=(256,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(32).repeat()
    with strategy.scope():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, "relu"), keras.layers.Dense(4)])
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    profiler = tfscale.callbacks.CommunicationProfiler(log_dir, profile_steps=(2, 3))
    traced = 0
    for _ in range(windows):
        model.fit(dataset, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[profiler])
        traced += bool(profiler.report.get("traced", True))
    return traced


def _train_job(run, root, data_dir):
    command = [sys.executable, "-m", "tfscale.train", *QUICK, "--strategy=multi_worker"]
    command += [f"--data_dir={data_dir}", f"--model_dir={root}/run{run}", "--profile_steps=4:6"]
    return run_local_cluster(
        command, 2, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=300, check=False, failure_grace=10
    )


def _windows_job(run, root, windows):
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    import _profiler_repro  # The target must be importable by module name in each task.

    env = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": here}
    args = (windows, f"{root}/run{run}")
    return run_local_cluster(
        _profiler_repro.windows_task, 2, args=args, env=env, timeout=600, check=False, failure_grace=10
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--windows", type=int, default=0, help="K profiled fits per task instead of tfscale-train"
    )
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="profiler-repro-")
    data_dir = f"{root}/tfds"
    if not args.windows:
        digits.prepare(data_dir)
    failed = 0
    for run in range(1, args.runs + 1):
        start = time.time()
        tasks = _windows_job(run, root, args.windows) if args.windows else _train_job(run, root, data_dir)
        bad = [t for t in tasks if not t.ok]
        failed += bool(bad)
        codes = " ".join(f"{t.task_type}:{t.index}={t.returncode}" for t in tasks)
        if args.windows:
            codes += " traced " + " ".join(
                f"{t.task_type}:{t.index}={t.value}/{args.windows}" for t in tasks if t.ok
            )
        print(f"run {run}: {'CRASH' if bad else 'ok'} ({codes}) {time.time() - start:.0f}s", flush=True)
        for t in bad:
            print(f"--- {t.task_type}:{t.index} log tail:\n{t.log[-1500:]}", flush=True)
    print(f"{failed} of {args.runs} runs failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
