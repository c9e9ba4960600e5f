"""Launch overhead: time from `tfscale-launch` to the first training step, against starting by hand.

For 1, 2 and 4 local workers, starts the same Keras 3 multi-worker program
(`tests/_launch_train.py`, one short epoch) two ways:

* `tfscale-launch --num_workers N -- python tests/_launch_train.py ...`;
* by hand: N `python tests/_launch_train.py` processes started directly, each with a
  hand-written TF_CONFIG on ports picked here (what users do without a launcher).

The clock starts just before the first process is spawned and stops at the last
worker's first finished training step (each worker prints the wall-clock time of its
first step; collective training makes them within milliseconds of each other).
Prints a table of medians and the ratio launcher / by hand; writes
`bench/results/bench_launch.json`.

    python bench/bench_launch.py [--workers 1,2,4] [--repeats 3]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from tfscale.launch._procs import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "tests", "_launch_train.py")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "tfscale-launch")


def _first_steps(texts):
    times = [
        float(line.split()[-1]) for text in texts for line in text.splitlines() if "first-step-at" in line
    ]
    return times


def _env():
    return dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")


def by_launcher(num_workers, out_dir):
    started = time.time()
    run = subprocess.run(
        [
            LAUNCHER,
            "--num_workers",
            str(num_workers),
            "--",
            sys.executable,
            TRAIN,
            "--out",
            out_dir,
            "--epochs",
            "1",
        ],
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    times = _first_steps([run.stdout])
    assert len(times) == num_workers, run.stdout[-2000:]
    return max(times) - started


def _ports(count):
    return free_ports(count)


def by_hand(num_workers, out_dir):
    workers = [f"127.0.0.1:{p}" for p in _ports(num_workers)]
    started = time.time()
    procs = []
    for index in range(num_workers):
        tf_config = json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})
        procs.append(
            subprocess.Popen(
                [sys.executable, TRAIN, "--out", out_dir, "--epochs", "1"],
                env=dict(_env(), TF_CONFIG=tf_config),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                # As from separate terminals: each its own session. Linux's scheduler
                # autogroups by session, so N workers in one session would share one CPU
                # share against the rest of the machine (the launcher also uses a session
                # per task).
                start_new_session=True,
            )
        )
    outputs = [p.communicate()[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    times = _first_steps(outputs)
    assert len(times) == num_workers
    return max(times) - started


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2,4")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for num_workers in [int(n) for n in args.workers.split(",")]:
        seconds = {"launcher": [], "by_hand": []}
        for _ in range(args.repeats):
            for name, fn in (("by_hand", by_hand), ("launcher", by_launcher)):  # interleaved: same load
                with tempfile.TemporaryDirectory() as out_dir:
                    seconds[name].append(fn(num_workers, out_dir))
        launcher, hand = statistics.median(seconds["launcher"]), statistics.median(seconds["by_hand"])
        rows.append(
            {
                "workers": num_workers,
                "launcher_s": launcher,
                "by_hand_s": hand,
                "ratio": launcher / hand,
                **seconds,
            }
        )
        print(f"{num_workers} workers: launcher {launcher:.2f}s, by hand {hand:.2f}s", flush=True)
    print(f"\n{'workers':>7} | {'tfscale-launch (s)':>18} | {'by hand (s)':>11} | {'ratio':>5}")
    for row in rows:
        cells = (row["workers"], row["launcher_s"], row["by_hand_s"], row["ratio"])
        print("{:>7} | {:>18.2f} | {:>11.2f} | {:>5.2f}".format(*cells))
    print(f"medians of {args.repeats} runs; clock: process spawn -> last worker's first finished step")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "bench_launch.json"), "w") as f:
        json.dump({"repeats": args.repeats, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
