"""Chaos runs for `tfscale.callbacks.BackupAndRestore`: SIGKILL at random steps, restart, compare.

Each trial starts the tiny training of `tests/_backup_workers.py` (3 epochs x 16 steps,
dropout, Adam, a compiled metric, backups every `save_freq` steps), kills it with a real
SIGKILL at a global step (`FailAt(mode="sigkill")`), restarts the same command, and
compares the final weights with an uninterrupted run. `save_freq` and the kill step are
drawn per trial so that backups land on epoch ends, on the run's end and mid-epoch
alike: a third of the trials kill right after an epoch-end backup (save_freq dividing
the epoch's 16 steps, killed at the step after it), some right after the run's last
step was backed up, the rest at a random step with a random save_freq
(`--save_freq N` fixes it for every trial instead). Prints one row per trial and writes JSON
to `bench/results/chaos_backup[_workers2][_stock].json`.

    python bench/chaos_backup.py --trials 20            # single process, drawn save_freq
    python bench/chaos_backup.py --trials 5 --workers 2 # 2-worker multi_worker cluster
    python bench/chaos_backup.py --trials 5 --stock     # keras.callbacks.BackupAndRestore
    python bench/chaos_backup.py --trials 20 --sync     # async_save=False

With `async_save` (the default here) every 4th trial is killed on purpose while a
background write is in flight: its writes are slowed by `--slow_write` seconds (and its
steps by `--slow_step`, so that a write takes fewer than `save_freq` steps and overlaps
them) and the writer's process SIGKILLs itself at the first step end (from a random step on) at which
a write is in flight, so the backup being written is lost. Every trial must lose at most
`save_freq` steps, sync or async (async snapshots early enough for that); the last line
gives how many lost more and the most lost.
"""

import argparse
import json
import os
import pickle
import random
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "tests", "_backup_workers.py")
TOTAL_STEPS = 48
STEP_RE = re.compile(r"tfscale-test global_step (\d+)")


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a["weights"], b["weights"]))


def _run_process(config):
    out = config["backup_dir"] + f".result-{time.monotonic_ns()}.pkl"
    proc = subprocess.run(
        [sys.executable, SCRIPT, json.dumps({**config, "out": out, "print_steps": True})],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        timeout=600,
        check=False,
    )
    steps = [int(s) for s in STEP_RE.findall(proc.stdout)]
    result = None
    if os.path.exists(out):
        with open(out, "rb") as f:
            result = pickle.load(f)
    return [
        {
            "code": proc.returncode,
            "last_step": steps[-1] if steps else 0,
            "result": result,
            "log": proc.stderr,
        }
    ]


def _run_cluster(config):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import _backup_workers

    from tfscale.launch import run_local_cluster

    config = dict(config)
    backup_dir = config.pop("backup_dir")
    results = run_local_cluster(
        _backup_workers.cluster_train,
        num_workers=2,
        args=(backup_dir,),
        kwargs={**config, "print_steps": True},
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
        check=False,
        timeout=600,
        failure_grace=5,
    )
    return [
        {
            "code": r.returncode,
            "last_step": max([0] + [int(s) for s in STEP_RE.findall(r.log)]),
            "result": r.value,
            "log": r.log,
        }
        for r in results
    ]


def _first_error(tasks):
    for t in tasks:
        for line in t["log"].splitlines():
            if re.match(r"^\w*(Error|Exception)\b", line):
                return f"{'process' if len(tasks) < 3 else 'task'} exit {t['code']}: {line.strip()[:200]}"
    return "no error line in the logs"


def _trial(run, base, kill_step, kill_task, reference, *, slow_write=0.0, slow_step=0.0):
    if slow_write:  # the writer kills itself at the first step end >= kill_step with a write in flight
        fail = {"in_flight_after": kill_step}
    else:
        fail = {"step": kill_step, "mode": "sigkill"}
    if kill_task is not None:
        fail["task"] = kill_task
    slow = {"slow_write": slow_write, "slow_step": slow_step} if slow_write else {}
    killed = run({**base, "fail": fail, **slow})
    last = max(t["last_step"] for t in killed)
    resumed = run(base)
    row = {"kill_step": kill_step, "killed_codes": [t["code"] for t in killed], "last_finished_step": last}
    if not all(t["code"] == 0 and t["result"] for t in resumed):
        row.update(ok=False, error=_first_error(resumed + killed))
        return row
    steps_run = resumed[0]["result"]["steps_run"]
    resumed_at = TOTAL_STEPS - steps_run
    diff = max(_max_diff(t["result"], r["result"]) for t, r in zip(resumed, reference))
    lost = last - resumed_at
    # Sync or async, a kill loses at most save_freq steps: with async_save, snapshots come
    # early enough that the write in flight is never the only backup less than save_freq old.
    allowed = base["save_freq"]  # one save_freq per trial
    row.update(
        resumed_at=resumed_at,
        steps_lost=lost,
        steps_run=steps_run,
        max_abs_diff=diff,
        ok=bool(diff <= 1e-6 and 0 <= lost <= allowed),
    )
    return row


def _draw(i, rng, fixed):
    """`(save_freq, kill_step, where)` of trial `i`: after an epoch-end backup, the run's end, mid-epoch."""
    kind = ("epoch end", "mid-epoch", "epoch end", "run end", "mid-epoch", "epoch end")[i % 6]
    if kind == "epoch end":
        save_freq = fixed or rng.choice([2, 4, 8, 16])
        return save_freq, 16 * rng.randint(1, 2) + 1, kind  # killed one step after the backup
    if kind == "run end":
        save_freq = fixed or rng.choice([4, 8, 16])
        return save_freq, TOTAL_STEPS, kind
    return fixed or rng.choice([3, 5, 6, 7]), rng.randint(1, TOTAL_STEPS - 1), kind


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--workers", type=int, choices=(1, 2), default=1)
    parser.add_argument("--save_freq", type=int, default=None, help="fixed for every trial (default: drawn)")
    parser.add_argument("--stock", action="store_true", help="use keras.callbacks.BackupAndRestore")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sync", action="store_true", help="async_save=False")
    parser.add_argument(
        "--slow_write", type=float, default=0.15, help="seconds added to in-flight trials' writes"
    )
    parser.add_argument(
        "--slow_step",
        type=float,
        default=0.05,
        help="seconds added to in-flight trials' steps (a write overlaps steps only if it takes "
        "fewer than save_freq of them; else each step waits for it)",
    )
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    run = _run_cluster if args.workers == 2 else _run_process
    workdir = tempfile.mkdtemp(prefix="tfscale-chaos-")
    base = {"stock": args.stock, "metrics": ["mae"], "scoped": False}
    if not args.stock:
        base["async_save"] = not args.sync
    in_flight = not args.stock and not args.sync
    reference = run(
        {**base, "save_freq": 5, "backup_dir": os.path.join(workdir, "reference"), "stock": False}
    )
    rows = []
    header = f"{'trial':>5} {'where':>9} {'freq':>4} {'kill':>5} {'flight':>6} {'resumed_at':>10}"
    header += f" {'lost':>5} {'ran':>4}"
    print(f"{header} {'max|diff|':>10}  ok")
    for i in range(args.trials):
        save_freq, kill_step, where = _draw(i, rng, args.save_freq)
        task = ("worker", rng.randint(0, 1)) if args.workers == 2 else None
        slow = 0.0
        if in_flight and i % 4 == 3 and where == "mid-epoch":
            # Killed while a write (slowed by `slow_write` s) is in flight, at the first step end
            # from `kill_step` on at which one is: the writer's process (worker 0 in a cluster).
            slow, where = args.slow_write, "in flight"
            save_freq = args.save_freq or 5
            kill_step = rng.randint(1, TOTAL_STEPS - 3 * save_freq)
            task = ("worker", 0) if args.workers == 2 else None
        row = _trial(
            run,
            {
                **base,
                "save_freq": save_freq,
                "backup_dir": os.path.join(workdir, f"t{i}"),
                # async_save snapshots early (not at multiples of save_freq): the epoch-end and
                # run-end trials write synchronously, so their backups land exactly there.
                **({"async_save": False} if where in ("epoch end", "run end") and not args.stock else {}),
            },
            kill_step,
            task,
            reference,
            slow_write=slow,
            slow_step=args.slow_step,
        )
        row.update(trial=i, killed_task=task, kill_in_flight=bool(slow), save_freq=save_freq, where=where)
        rows.append(row)
        print(
            f"{i:>5} {where:>9} {save_freq:>4} {kill_step:>5} {'yes' if slow else 'no':>6} "
            f"{row.get('resumed_at', '-')!s:>10} {row.get('steps_lost', '-')!s:>5} "
            f"{row.get('steps_run', '-')!s:>4} {row.get('max_abs_diff', float('nan')):>10.2e}  {row['ok']}"
            f"  {row.get('error', '')}",
            flush=True,
        )
    passed = sum(r["ok"] for r in rows)
    most_lost = max((r.get("steps_lost", 0) for r in rows), default=0)
    flights = sum(r["kill_in_flight"] for r in rows)
    over = sum(r.get("steps_lost", 0) > r["save_freq"] for r in rows)
    by_where = {
        w: sum(r["where"] == w for r in rows) for w in ("epoch end", "run end", "mid-epoch", "in flight")
    }
    print(
        f"{passed}/{len(rows)} trials resumed exactly (max |diff| <= 1e-6, steps lost <= save_freq); "
        f"kills by where the newest backup was: {by_where}; {flights} killed mid-write on "
        f"purpose; {over} lost more than their save_freq; most lost: {most_lost}"
    )
    name = "chaos_backup" + ("_workers2" if args.workers == 2 else "") + ("_stock" if args.stock else "")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", name + ".json"), "w") as f:
        json.dump({"args": vars(args), "trials": rows, "passed": passed}, f, indent=1)
    return 0 if passed == len(rows) or args.stock else 1


if __name__ == "__main__":
    sys.exit(main())
