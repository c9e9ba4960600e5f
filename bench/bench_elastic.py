"""Elastic resize times: kill -> first step on the smaller cluster, host back -> first step on the larger.

Runs the Keras 3 multi-worker program `tests/_launch_train.py` (backups every 4 steps,
`--step_sleep` per step so there is time to act) on 3 local workers:

* elastic (`--num_workers 2:3`, a discovery command reading a file): after worker 0's
  step 8 the slot of worker 2 is unlisted and its process SIGKILLed; `shrink_s` is the
  time from the kill to the first step trained on 2 workers. After that first step the
  slot is listed again; `grow_s` is the time from then to the first step trained on 3
  (one discovery poll, the SIGTERM backup on 2 workers, the 3-worker start and restore);
* plain restart (`--num_workers 3 --max_restarts 1`): the same kill; `restart_s` is the
  time from the kill to the first step of the restarted 3-worker job.

Each task prints the wall-clock time of its first step (`first-step-at T`). Prints
medians of `--repeats` runs; writes `bench/results/elastic.json` with `shrink_s`,
`grow_s`, `restart_s` (medians) and every sample.

    python bench/bench_elastic.py [--repeats 3] [--step_sleep 0.1]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(os.path.dirname(HERE), "tests", "_launch_train.py")
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "tfscale-launch")
RESULTS = os.path.join(HERE, "results", "elastic.json")


class _Job:
    """A running launcher whose merged output is read line by line."""

    def __init__(self, args):
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [LAUNCHER, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines = []

    def until(self, needle, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.lines.append(line)
            if needle in line:
                return line
        self.proc.kill()
        raise RuntimeError(f"{needle!r} not seen; output ends with:\n{''.join(self.lines[-30:])}")

    def first_step(self):
        """The wall-clock time of worker 0's next first step (a new attempt's)."""
        return float(self.until("[worker:0] first-step-at").split()[-1])

    def finish(self):
        out, _ = self.proc.communicate(timeout=600)
        if self.proc.returncode != 0:
            raise RuntimeError(f"the job failed:\n{''.join(self.lines[-30:])}{out[-3000:]}")


def _kill_worker_2(job):
    """SIGKILLs worker 2's task (its pid from the launcher's children); returns the time."""
    for pid in map(int, subprocess.check_output(["pgrep", "-P", str(job.proc.pid)], text=True).split()):
        with open(f"/proc/{pid}/environ", "rb") as f:
            if b'"task":{"type":"worker","index":2}' in f.read():
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                return killed
    raise RuntimeError("worker 2 not found")


def _train_args(work, step_sleep):
    return ["--", sys.executable, TRAIN, "--out", work, "--epochs", "8", "--step_sleep", str(step_sleep),
            "--backup_dir", os.path.join(work, "backup"), "--save_freq", "4"]  # fmt: skip


def elastic_once(work, step_sleep):
    usable = os.path.join(work, "usable")
    with open(usable, "w") as f:
        f.write("localhost:3\n")
    job = _Job(["--num_workers", "2:3", "--host_discovery", f"cat {usable}", "--discovery_interval", "0.5",
                "--resize_cooldown", "0",  # the grow's own latency, not the default 30 s hold
                "--max_restarts", "1", "--restart_backoff", "0", "--grace_period", "5",
                *_train_args(work, step_sleep)])  # fmt: skip
    job.until("[worker:0] step 8\n")
    with open(usable, "w") as f:
        f.write("localhost:2\n")
    killed = _kill_worker_2(job)
    shrunk = job.first_step()
    back = time.time()
    with open(usable, "w") as f:
        f.write("localhost:3\n")
    job.until("elastic: running from 2 to 3 workers")
    grown = job.first_step()
    job.finish()
    return shrunk - killed, grown - back


def restart_once(work, step_sleep):
    job = _Job(["--num_workers", "3", "--max_restarts", "1", "--restart_backoff", "0", "--grace_period", "5",
                *_train_args(work, step_sleep)])  # fmt: skip
    job.until("[worker:0] step 8\n")
    killed = _kill_worker_2(job)
    restarted = job.first_step()
    job.finish()
    return restarted - killed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--step_sleep", type=float, default=0.1)
    args = parser.parse_args()
    samples = {"shrink_s": [], "grow_s": [], "restart_s": []}
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as work:
            shrink, grow = elastic_once(work, args.step_sleep)
        with tempfile.TemporaryDirectory(prefix="bench-elastic-") as work:
            restart = restart_once(work, args.step_sleep)
        for key, value in (("shrink_s", shrink), ("grow_s", grow), ("restart_s", restart)):
            samples[key].append(round(value, 3))
        print(
            f"run {i + 1}: shrink {shrink:.2f} s, grow {grow:.2f} s, plain restart {restart:.2f} s",
            flush=True,
        )
    medians = {key: statistics.median(values) for key, values in samples.items()}
    print("\n| shrink: kill -> first step on 2 | grow: back -> first step on 3 | plain restart on 3 |")
    print("|---|---|---|")
    print(f"| {medians['shrink_s']:.2f} s | {medians['grow_s']:.2f} s | {medians['restart_s']:.2f} s |")
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(
            {**medians, "samples": samples, "repeats": args.repeats, "step_sleep": args.step_sleep},
            f,
            indent=1,
        )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
