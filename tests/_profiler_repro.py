"""Reproducer for issue 28's profiler crash (not a test: too slow for the suite).

Runs N two-worker `tfscale-train --strategy=multi_worker --profile_steps=4:6` jobs (the
QUICK flags of tests/test_train.py's `multi_worker` fixture) one after another and counts
the runs in which a task did not exit 0, printing each failing task's exit and log tail
(the known crash: worker 1, abort (signal 6), `free(): invalid pointer` at
`tf.profiler.experimental.stop()`).

    nice -n 5 .venv/bin/python tests/_profiler_repro.py --runs 40
"""

import argparse
import sys
import tempfile
import time

from tfscale.datasets import digits
from tfscale.launch import run_local_cluster

QUICK = ("--epochs=3", "--global_batch_size=64", "--seed=0")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="profiler-repro-")
    data_dir = f"{root}/tfds"
    digits.prepare(data_dir)
    failed = 0
    for run in range(1, args.runs + 1):
        start = time.time()
        command = [sys.executable, "-m", "tfscale.train", *QUICK, "--strategy=multi_worker"]
        command += [f"--data_dir={data_dir}", f"--model_dir={root}/run{run}", "--profile_steps=4:6"]
        tasks = run_local_cluster(
            command, 2, env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=300, check=False, failure_grace=10
        )
        bad = [t for t in tasks if not t.ok]
        failed += bool(bad)
        codes = " ".join(f"{t.task_type}:{t.index}={t.returncode}" for t in tasks)
        print(f"run {run}: {'CRASH' if bad else 'ok'} ({codes}) {time.time() - start:.0f}s", flush=True)
        for t in bad:
            print(f"--- {t.task_type}:{t.index} log tail:\n{t.log[-1500:]}", flush=True)
    print(f"{failed} of {args.runs} runs failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
