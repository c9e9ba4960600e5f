"""`tfscale-tfconfig --from=hostfile` at scale: time and peak memory against the task count.

Writes hostfiles of N 'hostI slots=1' lines (N = 10k and 40k by default) and runs the
binary in a subprocess twice per N: printing one task's TF_CONFIG (`--task=worker:0`:
parse and validate the whole cluster once), and every task's (`--task=all`, output
discarded: N lines of N addresses each, so the bytes written grow with N squared).
Peak memory is the child's max RSS. Prints a table; writes `bench/results/bench_tfconfig.json`.

    python bench/bench_tfconfig.py [--tasks 10000,40000] [--all-up-to 10000]
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(hostfile, task):
    cmd = [
        sys.executable,
        "-m",
        "tfscale.cluster_cli",
        "--from=hostfile",
        f"--hostfile={hostfile}",
        f"--task={task}",
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    start = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        subprocess.run(cmd, stdout=sink, check=True)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return seconds, max(peak, before) / 1024  # ru_maxrss is in KiB on Linux; the max over children


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", default="10000,40000")
    parser.add_argument("--all-up-to", type=int, default=10000, help="largest N for --task=all")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.tasks.split(",")):
            hostfile = os.path.join(tmp, f"hosts{n}")
            with open(hostfile, "w") as f:
                f.writelines(f"host{i} slots=1\n" for i in range(n))
            for task in ("worker:0", "all"):
                if task == "all" and n > args.all_up_to:
                    continue
                seconds, peak_mib = _run(hostfile, task)
                rows.append(
                    {"tasks": n, "task": task, "seconds": round(seconds, 2), "peak_mib": round(peak_mib)}
                )
                print(
                    f"{n:>7} tasks  --task={task:<9} {seconds:8.2f} s  peak {peak_mib:6.0f} MiB", flush=True
                )
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "bench_tfconfig.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
