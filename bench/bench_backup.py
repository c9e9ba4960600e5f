"""Cost of `tfscale.callbacks.BackupAndRestore`: whole fit vs no callback, per save, restart.

Part 0, the figure a user feels (paired, `bench/_paired.py`): whole `fit` time with
`save_freq=100`, sync and async, against the same fit with no callback, in paired rounds
(each round runs no callback, an A/A control (no callback again), sync and async, in an
order that changes each round), each ratio to its own round's no-callback fit; median,
min and max, the load average at start and end. Internal shares of those same fits
(ms/save on the training thread, share, hooks, steps at risk) are secondary columns.

Part 1 (in this process): a small MLP (~285k parameters, Adam) trains 2 epochs x 512
steps with no backup, with `save_freq="epoch"` and with `save_freq=100`, with
`async_save` on and off side by side; prints the time each save takes on the training
thread (async: the snapshot to host memory, plus any wait for the previous write), the
size of a backup, the share of fit time spent saving on the training thread, and the
whole fit against no callback (which also counts the background thread's CPU use).
`save_freq=2` with async shows what happens when a backup is due while the previous one
is still being written (it waits: the `waits` column).

Part 1b: peak extra host memory of one fit with backups (tracemalloc: numpy copies and
write buffers, which is where the snapshot lives), next to the size of the state.

Part 2 (real processes): the training of `tests/_backup_workers.py` with 1024 steps an
epoch is SIGKILLed at step 900 and restarted; prints the time from the restarted
process's start to its first resumed step, next to a fresh start of the same script
(the difference is restore + skipping 900 consumed batches).

    python bench/bench_backup.py [--rounds 8] [--steps_per_epoch 512] [--repeat 3] [--skip_restart]
    python bench/bench_backup.py --rounds 8 --paired_only   # part 0 only

Writes `bench/results/bench_backup.json`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _paired  # noqa: E402  (bench/ is not a package: the script's folder is on sys.path)

SCRIPT = os.path.join(HERE, "..", "tests", "_backup_workers.py")


def _timed_callback_class():
    import tfscale.callbacks

    class TimedBackup(tfscale.callbacks.BackupAndRestore):
        """Records the training thread's time spent saving (snapshots, synchronous writes,
        waits for a background write; with async and a step count, the per-step schedule
        check too), its time in all of the callback's step and epoch hooks (which adds the
        per-step SIGTERM check), and the most steps ever at risk (after a step, the steps
        since the newest published backup, +1 for the step about to run)."""

        saves = 0
        save_seconds = 0.0
        hook_seconds = 0.0
        writer_waits = 0
        most_at_risk = 0
        _in_schedule = False

        def _save(self, *args, **kwargs):
            start = time.perf_counter()
            super()._save(*args, **kwargs)
            self.saves += 1
            if not self._in_schedule:  # else counted by _save_if_due
                self.save_seconds += time.perf_counter() - start

        def _save_if_due(self, before, done):
            start = time.perf_counter()
            self._in_schedule = True
            try:
                super()._save_if_due(before, done)
            finally:
                self._in_schedule = False
            self.save_seconds += time.perf_counter() - start

        def on_train_batch_end(self, batch, logs=None):
            start = time.perf_counter()
            super().on_train_batch_end(batch, logs)
            self.hook_seconds += time.perf_counter() - start
            self.writer_waits = self._writer.waits
            self.most_at_risk = max(self.most_at_risk, self._global_step + 1 - self._policy.published_step)

        def on_epoch_end(self, epoch, logs=None):
            start = time.perf_counter()
            super().on_epoch_end(epoch, logs)
            self.hook_seconds += time.perf_counter() - start

    return TimedBackup


def _tf_checkpoint_callback(save_freq, backup_dir, async_save):
    """The library alternative: `tf.train.Checkpoint.write` every `save_freq` steps, timed.

    TensorFlow's own format (shards written where the variables live, optional async
    write); no manifest, checksum, publication by rename, fallback or input position.
    """
    import keras
    import tensorflow as tf

    class TfCheckpoint(keras.callbacks.Callback):
        save_seconds = ()
        writer_waits = 0

        def on_train_begin(self, logs=None):
            self.backup_dir = backup_dir
            self._ckpt = tf.train.Checkpoint(model=self.model, optimizer=self.model.optimizer)
            self._options = tf.train.CheckpointOptions(experimental_enable_async_checkpoint=async_save)
            self._n = 0

        def on_train_batch_end(self, batch, logs=None):
            self._n += 1
            if self._n % save_freq == 0:
                start = time.perf_counter()
                self._ckpt.write(os.path.join(backup_dir, f"ckpt-{self._n}"), options=self._options)
                self.save_seconds = (*self.save_seconds, time.perf_counter() - start)

        def on_train_end(self, logs=None):
            self._ckpt.sync()  # async writes finish here (counted in fit time, not per save)

    return TfCheckpoint()


def _callbacks(kind, save_freq, backup_dir, async_save=False):
    import keras

    if kind == "none":
        return []
    if kind == "tf.train.Checkpoint":
        return [_tf_checkpoint_callback(save_freq, backup_dir, async_save)]
    if kind == "keras":
        return [keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq, delete_checkpoint=False)]
    preemption = kind == "tfscale"
    timed = _timed_callback_class()
    return [
        timed(
            backup_dir,
            save_freq=save_freq,
            delete_checkpoint=False,
            save_before_preemption=preemption,
            async_save=async_save,
        )
    ]


def _fit_once(kind, save_freq, steps_per_epoch, workdir, async_save=False, *, trace_memory=False):
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    batch = 32
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps_per_epoch * batch, 32)).astype("float32")
    y = rng.normal(size=(steps_per_epoch * batch, 1)).astype("float32")
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(512, "relu"),
            keras.layers.Dense(512, "relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)  # trace once, outside the timing
    # A fresh directory per fit: with `delete_checkpoint=False` a reused one would resume a finished run.
    callbacks = _callbacks(kind, save_freq, os.path.join(tempfile.mkdtemp(dir=workdir), "backup"), async_save)
    if trace_memory:
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=2, callbacks=callbacks, verbose=0)
    total = time.perf_counter() - start
    peak_extra = None
    if trace_memory:
        peak_extra = tracemalloc.get_traced_memory()[1] - base
        tracemalloc.stop()
    timed = callbacks[0] if callbacks and hasattr(callbacks[0], "hook_seconds") else None
    tf_saves = getattr(callbacks[0], "save_seconds", ()) if callbacks and not timed else ()
    size = 0
    if callbacks:
        backup_dir = callbacks[0].backup_dir
        for root, _, files in os.walk(backup_dir):
            size += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return {
        "params": model.count_params(),
        "seconds": total,
        "saves": timed.saves if timed else len(tf_saves),
        "save_seconds": timed.save_seconds if timed else sum(tf_saves),
        "hook_seconds": timed.hook_seconds if timed else sum(tf_saves),
        "most_at_risk": timed.most_at_risk if timed else None,
        "disk_bytes": size,
        "waits": timed.writer_waits if timed else 0,
        "state_bytes": sum(v.value.numpy().nbytes for v in model.variables + model.optimizer.variables),
        "peak_extra_bytes": peak_extra,
    }


def _paired_fit_cost(steps_per_epoch, rounds, warmup=1):
    """Part 0: whole-fit cost of sync and async backups at save_freq=100, paired, with the control."""
    workdir = tempfile.mkdtemp(prefix="tfscale-bench-backup-paired-")

    def measure(kind, freq, async_save):
        def fit():
            r = _fit_once(kind, freq, steps_per_epoch, workdir, async_save)
            extras = {}
            if r["saves"]:
                extras = {
                    "ms_per_save": 1000 * r["save_seconds"] / r["saves"],
                    "share_of_fit": r["save_seconds"] / r["seconds"],
                    "hooks_share_of_fit": r["hook_seconds"] / r["seconds"],
                    "most_at_risk": r["most_at_risk"],
                    "waits": r["waits"],
                }
            return {"value": r["seconds"], **extras}

        return fit

    summary = _paired.run(
        {
            "no callback": measure("none", None, False),
            "sync 100": measure("tfscale", 100, False),
            "async 100": measure("tfscale", 100, True),
        },
        baseline="no callback",
        rounds=rounds,
        warmup=warmup,  # the first fits of a process run slower (seen: 3.5 s then 2.5 s)
    )
    variants = summary["variants"]
    print(
        f"whole fit vs no callback (2 epochs x {steps_per_epoch} steps, batch 32, Adam, "
        f"{rounds} paired rounds after {warmup} warm-up; median [min, max]; secondary columns: medians):"
    )
    print(
        f"{'callback':>12} {'fit vs none':>11} {'min':>8} {'max':>8} {'beyond A/A':>10} "
        f"{'fit s':>7} {'ms/save':>8} {'share':>6} {'hooks':>6} {'at risk':>7}"
    )
    for label in ("no callback", _paired.CONTROL, "sync 100", "async 100"):
        row = variants[label]
        ratio, extras = row["ratio"], row["extras"]
        beyond = _paired.beyond_control(summary, label) if extras else None
        beyond = f"{100 * beyond:>+9.1f}%" if beyond is not None else f"{'-':>10}"
        secondary = (
            f"{extras['ms_per_save']:>8.2f} {100 * extras['share_of_fit']:>5.1f}% "
            f"{100 * extras['hooks_share_of_fit']:>5.1f}% {extras['most_at_risk']:>7.0f}"
            if extras
            else f"{'-':>8} {'-':>6} {'-':>6} {'-':>7}"
        )
        print(
            f"{label:>12} {100 * (ratio['median'] - 1):>+10.1f}% {100 * (ratio['min'] - 1):>+7.1f}% "
            f"{100 * (ratio['max'] - 1):>+7.1f}% {beyond} {row['value']['median']:>7.2f} "
            f"{secondary}"
        )
    print(
        "beyond A/A: the median minus the A/A control's largest ratio (<= 0: within this machine's "
        f"noise); load average (1/5/15 min) at start {_paired._fmt_load(summary['load_start'])}, "
        f"at end {_paired._fmt_load(summary['load_end'])}"
    )
    return summary


def _save_costs(steps_per_epoch, repeat, only=None):

    workdir = tempfile.mkdtemp(prefix="tfscale-bench-backup-")
    rows, failures = {}, {}
    variants = (
        ("no callback", "none", None, False),
        ("keras epoch", "keras", "epoch", False),
        ("keras 100", "keras", 100, False),
        ("sync epoch", "tfscale", "epoch", False),
        ("async epoch", "tfscale", "epoch", True),
        ("sync 100", "tfscale", 100, False),
        ("async 100", "tfscale", 100, True),
        ("async 100 no SIGTERM", "tfscale-nopreempt", 100, True),
        ("tf.train.Checkpoint 100", "tf.train.Checkpoint", 100, False),
        ("... async", "tf.train.Checkpoint", 100, True),
        ("sync 2", "tfscale", 2, False),
        ("async 2", "tfscale", 2, True),
    )
    for label, kind, freq, async_save in variants:
        if only and label not in only and label != "no callback":
            continue
        # The machine may be shared: keep the fastest of `repeat` fits of each variant.
        try:
            runs = [_fit_once(kind, freq, steps_per_epoch, workdir, async_save) for _ in range(repeat)]
        except Exception as e:  # TF's async checkpoint cannot copy Keras 3 variables (TF 2.21)
            failures[label] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:150]}"
            continue
        rows[label] = min(runs, key=lambda r: r["seconds"])
    base = rows["no callback"]["seconds"]
    print(
        f"model: {rows['no callback']['params']} parameters, 2 epochs x {steps_per_epoch} steps, "
        f"batch 32, Adam; best of {repeat} fits"
    )
    print(
        f"{'callback, save_freq':>20} {'fit s':>7} {'step ms':>8} {'saves':>5} {'ms/save':>8} "
        f"{'waits':>5} {'at risk':>7} {'MB/backup':>9} {'share':>7} {'hooks':>6} {'vs no callback':>14}"
    )
    for label, r in rows.items():
        steps = 2 * steps_per_epoch
        per_save = 1000 * r["save_seconds"] / r["saves"] if r["saves"] else 0.0
        share = r["save_seconds"] / r["seconds"]
        mb = r["disk_bytes"] / 2**20
        r.update(
            step_ms=1000 * r["seconds"] / steps,
            ms_per_save=per_save,
            share_of_fit=share,
            hooks_share_of_fit=r["hook_seconds"] / r["seconds"],
            overhead=r["seconds"] / base - 1,
        )
        risk = "-" if r["most_at_risk"] is None else str(r["most_at_risk"])
        print(
            f"{label:>20} {r['seconds']:>7.2f} {r['step_ms']:>8.2f} {r['saves']:>5} {per_save:>8.2f} "
            f"{r['waits']:>5} {risk:>7} {mb:>9.2f} {100 * share:>6.1f}% "
            f"{100 * r['hooks_share_of_fit']:>5.1f}% {100 * r['overhead']:>+13.1f}%"
        )
    for label, error in failures.items():
        print(f"{label:>20} failed: {error}")
    print(
        "ms/save: the training thread's time saving (snapshots, synchronous writes, waits for a "
        "background write, the async schedule) per save; share: that, of fit time; hooks: all of the "
        "callback's step and epoch hooks (+ the per-step SIGTERM check), of fit time; at risk: most "
        "steps a kill could have lost; vs no callback: whole fit, best of N unpaired fits "
        "(indicative only on a shared machine: the paired table above is the figure)"
    )
    return {**rows, **{label: {"error": error} for label, error in failures.items()}}


def _peak_memory(steps_per_epoch):
    workdir = tempfile.mkdtemp(prefix="tfscale-bench-memory-")
    rows = {}
    for label, freq, async_save in (("sync 100", 100, False), ("async 100", 100, True)):
        rows[label] = _fit_once("tfscale", freq, steps_per_epoch, workdir, async_save, trace_memory=True)
    print("peak extra host memory during fit (tracemalloc), against the state's size:")
    for label, r in rows.items():
        print(
            f"{label:>20} peak {r['peak_extra_bytes'] / 2**20:6.2f} MB, "
            f"state {r['state_bytes'] / 2**20:6.2f} MB ({r['peak_extra_bytes'] / r['state_bytes']:.2f}x)"
        )
    return rows


def _restart_times():
    import pickle

    workdir = tempfile.mkdtemp(prefix="tfscale-bench-restart-")
    common = {"samples": 8192, "epochs": 1, "save_freq": 100, "print_steps": False}
    out = os.path.join(workdir, "r.pkl")
    rows = {}
    for label, backup_dir, fail in (
        ("fresh start", os.path.join(workdir, "fresh"), None),
        ("killed at 900", os.path.join(workdir, "killed"), {"step": 900, "mode": "sigkill"}),
    ):
        if fail:
            subprocess.run(
                [
                    sys.executable,
                    SCRIPT,
                    json.dumps({**common, "backup_dir": backup_dir, "out": out, "fail": fail}),
                ],
                capture_output=True,
                env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
                check=False,
            )
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, SCRIPT, json.dumps({**common, "backup_dir": backup_dir, "out": out})],
            capture_output=True,
            text=True,
            env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
            check=False,
        )
        wall = time.monotonic() - start
        with open(out, "rb") as f:
            result = pickle.load(f)
        rows[label] = {
            "process_seconds": wall,
            "fit_start_to_first_step": result["seconds_to_first_step"],
            "steps_run": result["steps_run"],
            "resumed_at": (result["restored"] or {}).get("global_step", 0),
            "returncode": proc.returncode,
        }
    print("restart (tests/_backup_workers.py, 1024 steps/epoch, backups every 100 steps):")
    print(f"{'run':>14} {'resumed_at':>10} {'steps run':>9} {'train() -> 1st step s':>22} {'process s':>9}")
    for label, r in rows.items():
        print(
            f"{label:>14} {r['resumed_at']:>10} {r['steps_run']:>9} {r['fit_start_to_first_step']:>22.2f} "
            f"{r['process_seconds']:>9.2f}"
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps_per_epoch", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds of part 0")
    parser.add_argument("--warmup", type=int, default=1, help="paired rounds run first, not counted")
    parser.add_argument("--paired_only", action="store_true", help="part 0 only")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--skip_restart", action="store_true")
    parser.add_argument("--only", nargs="*", help="variant labels to run (with 'no callback')")
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    results = {"whole_fit_paired": _paired_fit_cost(args.steps_per_epoch, args.rounds, args.warmup)}
    if not args.paired_only:
        results["save_cost"] = _save_costs(args.steps_per_epoch, args.repeat, args.only)
        results["peak_memory"] = _peak_memory(min(args.steps_per_epoch, 256))
    if not args.skip_restart and not args.paired_only:
        results["restart"] = _restart_times()
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "bench_backup.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
