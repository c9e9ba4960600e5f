"""tfscale.callbacks.BackupAndRestore and FailAt: real faults, real files, real processes.

Every resume is compared with an uninterrupted run of the same training (final weights
within 1e-6, and exactly the remaining steps run). In-process tests interrupt with
`FailAt(mode="raise")` (or a real SIGTERM to this process); the `slow` ones kill real
processes and 2-worker clusters, then restart them.
"""

import json
import logging
import os
import pickle
import re
import subprocess
import sys
import time
from unittest import mock

import _backup_workers as workers
import numpy as np
import pytest
from _backup_workers import flip_byte, listing

import tfscale.callbacks
from tfscale.callbacks import _backup_store, _backup_writer
from tfscale.launch import run_local_cluster

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_inconsistent_newest_backup_is_torn_and_falls_back": 2,
    "test_resumes_from_a_backup_at_the_last_step_of_an_epoch": 1,
}

TOTAL_STEPS = 48  # 3 epochs x 16 steps (128 samples, batch 8)
STATE = "shard-00000.npz"  # the one shard of a model on one device
SCRIPT = os.path.join(os.path.dirname(__file__), "_backup_workers.py")


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a["weights"], b["weights"]))


def settle(backup_dir):
    """After a `fit` that raised: waits for its background write (async_save) to publish."""
    _backup_writer.wait_for_directory(str(backup_dir))


def interrupt_then_resume(backup_dir, fail_step, **kwargs):
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(backup_dir, fail={"step": fail_step, "mode": "raise"}, **kwargs)
    return workers.train(backup_dir, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Uninterrupted runs, by (dataset, steps_per_execution, strategy)."""
    cache = {}

    def get(dataset="array", steps_per_execution=1, strategy="one_device"):
        key = (dataset, steps_per_execution, strategy)
        if key not in cache:
            path = tmp_path_factory.mktemp("reference")
            cache[key] = workers.train(
                str(path), dataset=dataset, steps_per_execution=steps_per_execution, strategy=strategy
            )
            assert cache[key]["steps_run"] == TOTAL_STEPS
        return cache[key]

    return get


# --- exact resume, in process ------------------------------------------------------------


@pytest.mark.parametrize(
    "dataset, steps_per_execution, fail_step",
    [
        pytest.param("array", 1, 16, marks=pytest.mark.slow),  # last step of epoch 0 (backup at 15)
        ("array", 1, 22),  # epoch 1, backup at 20 = step 4 of epoch 1
        ("tfdata_reshuffle", 1, 38),  # reshuffles every epoch: the resumed epoch must too
        pytest.param(
            "tfdata_repeat", 1, 36, marks=pytest.mark.slow
        ),  # steps_per_epoch: one iterator across epochs, 35 batches in
        pytest.param(
            "array", 2, 33, marks=pytest.mark.slow
        ),  # steps_per_execution=2: backups at 6, 16, 26, ... (every 2nd execution)
    ],
)
def test_resumes_mid_epoch_exactly(tmp_path, reference, dataset, steps_per_execution, fail_step):
    ref = reference(dataset, steps_per_execution)
    resumed = interrupt_then_resume(
        str(tmp_path / "b"), fail_step, dataset=dataset, steps_per_execution=steps_per_execution
    )
    restored = resumed["restored"]["global_step"]
    assert 0 <= fail_step - restored <= 5 + steps_per_execution - 1  # steps lost <= save_freq (+ execution)
    assert resumed["steps_run"] == TOTAL_STEPS - restored
    assert resumed["global_step"] == TOTAL_STEPS
    assert max_diff(resumed, ref) <= 1e-6


# A backup at the last step of an epoch (save_freq divides the epoch's 16 steps) left a
# resumed epoch with no step: Keras then read metrics never built and every restart raised
# "Cannot get result() since the metric has not yet been built".
@pytest.mark.parametrize(
    "dataset, save_freq, fail_step, at, scoped",
    [
        ("array", 4, 17, 16, False),  # backup at 16: the last step of epoch 0
        pytest.param("array", 8, 33, 32, True, marks=pytest.mark.slow),  # the last step of epoch 1
        ("array", 16, 48, 48, False),  # at 48: the last step of the run
        ("tfdata_repeat", 4, 17, 16, False),  # steps_per_epoch: one iterator across epochs
        pytest.param("tfdata_reshuffle", 8, 33, 32, False, marks=pytest.mark.slow),
        # A length Keras learns only when the input ends: the step that finds the end
        # counts in `optimizer.iterations` (which FailAt reads), so step 18 is global step 17.
        pytest.param("tfdata_unknown", 4, 18, 16, False, marks=pytest.mark.slow),
    ],
)
def test_resumes_from_a_backup_at_the_last_step_of_an_epoch(
    tmp_path, dataset, save_freq, fail_step, at, scoped
):
    kwargs = {"dataset": dataset, "save_freq": save_freq, "metrics": ["mae"], "scoped": scoped}
    ref = workers.train(str(tmp_path / "ref"), **kwargs)
    resumed = interrupt_then_resume(str(tmp_path / "b"), fail_step, **kwargs)
    restored = resumed["restored"]
    assert (restored["global_step"], restored["step"]) == (at, 16)
    assert resumed["steps_run"] == TOTAL_STEPS - at
    assert max_diff(resumed, ref) <= 1e-6


def test_fault_between_backups_fires_only_in_its_attempt(tmp_path, reference):
    """`restart_count=0`: the restarted attempt replays step 22 (backup at 20) without failing."""
    fail = {"step": 22, "mode": "raise", "restart_count": 0}
    backup_dir = str(tmp_path / "b")
    with mock.patch.dict(os.environ, {"TFSCALE_RESTART_COUNT": "0"}):
        with pytest.raises(tfscale.callbacks.InjectedFault):
            workers.train(backup_dir, fail=fail)
    with mock.patch.dict(os.environ, {"TFSCALE_RESTART_COUNT": "1"}):
        resumed = workers.train(backup_dir, fail=fail)
    assert resumed["restored"]["global_step"] == 20
    assert resumed["steps_run"] == TOTAL_STEPS - 20
    assert max_diff(resumed, reference()) <= 1e-6


def test_resumes_exactly_under_mirrored(tmp_path, reference):
    ref = reference(strategy="mirrored")
    resumed = interrupt_then_resume(str(tmp_path / "b"), 27, strategy="mirrored")
    assert resumed["restored"]["global_step"] == 25
    assert resumed["steps_run"] == TOTAL_STEPS - 25
    assert max_diff(resumed, ref) <= 1e-6


def job_history(epoch_logs):
    """`{key: [value per epoch]}` of a job's attempts (a later attempt's epoch replaces an earlier one's)."""
    by_epoch = dict(epoch_logs)
    return {k: [by_epoch[e][k] for e in sorted(by_epoch)] for k in by_epoch[min(by_epoch)]}


# Keras resets the metrics as each epoch begins: a resumed epoch used to log the mean of
# only the steps run after the restart (loss, mae), unlike the uninterrupted run.
# Unscoped: compiled outside any strategy scope, Keras builds `mae` only at the first step.
@pytest.mark.parametrize(
    "strategy, scoped, fail_step, at",
    [
        ("one_device", True, 22, 20),
        # 13 s; the fast tier resumes under mirrored in test_resumes_exactly_under_mirrored
        pytest.param("mirrored", True, 27, 25, marks=pytest.mark.slow),
        ("one_device", False, 22, 20),
    ],
    ids=["one_device", "mirrored", "unscoped"],
)
def test_resumed_epoch_logs_the_metrics_of_all_its_steps(tmp_path, strategy, scoped, fail_step, at):
    kwargs = {"strategy": strategy, "metrics": ["mae"], "scoped": scoped}
    ref_logs, job_logs = [], []
    ref = workers.train(str(tmp_path / "ref"), epoch_logs=ref_logs, **kwargs)
    with pytest.raises(tfscale.callbacks.InjectedFault):
        fail = {"step": fail_step, "mode": "raise"}
        workers.train(str(tmp_path / "b"), fail=fail, epoch_logs=job_logs, **kwargs)
    assert [e for e, _ in job_logs] == [0]
    resumed = workers.train(str(tmp_path / "b"), epoch_logs=job_logs, **kwargs)
    assert (resumed["restored"]["global_step"], resumed["restored"]["step"]) == (at, at - 16)
    expected, got = job_history(ref_logs), job_history(job_logs)
    assert sorted(got) == sorted(expected) == ["loss", "mae"]
    for key in expected:
        np.testing.assert_allclose(got[key], expected[key], rtol=0, atol=1e-6, err_msg=key)
    assert max_diff(resumed, ref) <= 1e-6


def test_backup_without_metric_state_resumes_as_before(tmp_path, reference):
    """A backup made before the metric state was saved (format 3) still restores the rest."""

    class MetriclessBackup(tfscale.callbacks.BackupAndRestore):
        def _saved_variables(self):
            model_vars, opt_vars = self._variables()
            return model_vars + opt_vars

        def _meta(self, at_epoch_end):
            meta = super()._meta(at_epoch_end)
            del meta["metric_variables"]
            return meta

    backup_dir = str(tmp_path / "b")
    with mock.patch.object(_backup_store, "FORMAT_VERSION", 3):
        with pytest.raises(tfscale.callbacks.InjectedFault):
            workers.train(backup_dir, fail={"step": 22, "mode": "raise"}, callback_class=MetriclessBackup)
    with open(os.path.join(backup_dir, "ckpt-000000000020", "manifest.json")) as f:
        assert json.load(f)["format"] == 3
    resumed = workers.train(backup_dir)
    assert resumed["restored"]["global_step"] == 20
    assert "metric_variables" not in resumed["restored"]
    assert resumed["steps_run"] == TOTAL_STEPS - 20
    assert max_diff(resumed, reference()) <= 1e-6


def test_stock_keras_callback_reruns_the_epoch_and_diverges(tmp_path, reference):
    """The problem this callback fixes, shown: Keras 3's own restarts the epoch."""
    ref = reference()
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(tmp_path / "b"), stock=True, fail={"step": 22, "mode": "raise"})
    resumed = workers.train(str(tmp_path / "b"), stock=True)
    assert resumed["steps_run"] == 32  # epochs 1 and 2 again: 16 - 4 steps re-run
    assert max_diff(resumed, ref) > 1e-4


def test_backup_at_epoch_end_resumes_at_next_epoch(tmp_path, reference):
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(tmp_path / "b"), save_freq="epoch", fail={"step": 40, "mode": "raise"})
    resumed = workers.train(str(tmp_path / "b"), save_freq="epoch")
    assert (resumed["restored"]["epoch"], resumed["restored"]["step"]) == (2, 0)
    assert resumed["steps_run"] == 16
    assert max_diff(resumed, reference()) <= 1e-6


# --- atomicity, torn backups, retention ----------------------------------------------------


def backups(path):
    return sorted(n for n in os.listdir(path) if n.startswith("ckpt-"))


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize(
    "damage, target",
    [
        (_truncate, STATE),
        (flip_byte, STATE),
        (_truncate, "manifest.json"),
    ],
)
def test_store_rejects_torn_backup_and_loads_the_previous(tmp_path, caplog, damage, target):
    store = _backup_store.BackupStore(str(tmp_path), max_to_keep=2)
    for step in (10, 20):
        arrays = [np.full((50, 50), step, np.float32), np.arange(step)]
        store.write(step, {"step": step}, [_backup_store.NpzShard("/cpu:0", [0, 1], arrays)])
    damage(str(tmp_path / "ckpt-000000000020" / target))
    with caplog.at_level(logging.WARNING, logger="tfscale"):
        backup, rejected = store.load_newest()
    assert rejected == ["ckpt-000000000020"]
    assert backup.meta == {"step": 10} and float(backup.arrays[0][0, 0]) == 10.0
    assert "ckpt-000000000020 is unusable" in caplog.text
    # The kept record holds the message, not the exception (whose traceback would keep the
    # frames of a refused fit, and its input iterator, alive; tests/test_log_records.py).
    assert not [a for r in caplog.records for a in (r.args or ()) if isinstance(a, BaseException)]
    with pytest.raises(_backup_store.UnusableBackupError):
        store.load("ckpt-000000000020")


def test_torn_newest_backup_falls_back_to_previous(tmp_path, reference, caplog):
    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(backup_dir), max_to_keep=2, fail={"step": 22, "mode": "raise"})
    settle(backup_dir)
    assert backups(backup_dir) == ["ckpt-000000000015", "ckpt-000000000020"]
    _truncate(str(backup_dir / "ckpt-000000000020" / STATE))
    with caplog.at_level(logging.WARNING, logger="tfscale"):
        resumed = workers.train(str(backup_dir), max_to_keep=2, delete_checkpoint=False)
    assert "ckpt-000000000020 is unusable" in caplog.text
    assert "falling back to the previous backup" in caplog.text
    assert resumed["restored"]["global_step"] == 15
    assert resumed["steps_run"] == TOTAL_STEPS - 15
    assert max_diff(resumed, reference()) <= 1e-6
    # The torn ckpt-20 was replaced when the resumed run reached step 20 again.
    assert listing(backup_dir) == ["ckpt-000000000040", "ckpt-000000000045"]


def test_all_backups_torn_is_an_error_not_a_fresh_start(tmp_path):
    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(backup_dir), fail={"step": 12, "mode": "raise"})
    _truncate(str(backup_dir / "ckpt-000000000010" / STATE))
    with pytest.raises(tfscale.callbacks.UnusableBackupError, match="all 1 are torn or corrupt"):
        workers.train(str(backup_dir))


def test_crash_while_writing_publishes_nothing_and_keeps_the_last_backup(tmp_path):
    backup_dir = tmp_path / "b"
    real_savez = np.savez
    calls = {"n": 0}

    def savez_dies_on_third_backup(f, *arrays):
        calls["n"] += 1
        if calls["n"] == 3:
            f.write(b"PK\x03\x04 half a file")
            raise OSError("disk full (injected)")
        return real_savez(f, *arrays)

    with mock.patch.object(_backup_store.np, "savez", savez_dies_on_third_backup):
        with pytest.raises(
            tfscale.callbacks.BackupWriteError, match=r"step 15 .*injected.*ckpt-000000000010"
        ):
            workers.train(str(backup_dir), max_to_keep=1)
    assert listing(backup_dir) == ["ckpt-000000000010"]  # the torn write removed, the last kept
    resumed = workers.train(str(backup_dir), max_to_keep=1, delete_checkpoint=False)
    assert resumed["restored"]["global_step"] == 10
    assert listing(backup_dir) == ["ckpt-000000000045"]  # stale temp dir cleaned, one kept


def test_keeps_last_k_and_deletes_on_success(tmp_path):
    kept = workers.train(str(tmp_path / "keep"), max_to_keep=3, delete_checkpoint=False)
    assert backups(tmp_path / "keep") == ["ckpt-000000000035", "ckpt-000000000040", "ckpt-000000000045"]
    manifest = json.loads((tmp_path / "keep" / "ckpt-000000000045" / "manifest.json").read_text())
    assert (manifest["meta"]["epoch"], manifest["meta"]["step"], manifest["meta"]["global_step"]) == (
        2,
        13,
        45,
    )
    assert kept["steps_run"] == TOTAL_STEPS
    workers.train(str(tmp_path / "gone"))
    assert not (tmp_path / "gone").exists()


def test_backup_of_a_different_model_is_refused(tmp_path):
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(tmp_path / "b"), fail={"step": 6, "mode": "raise"})
    with pytest.raises(
        tfscale.callbacks.BackupMismatchError, match=r"different model \(variable 0 is .*\(8, 16\)"
    ):
        workers.train(str(tmp_path / "b"), units=32)
    assert backups(tmp_path / "b") == ["ckpt-000000000005"]  # untouched


def test_non_writer_task_writes_nothing(tmp_path):
    tf_config = {
        "cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
        "task": {"type": "worker", "index": 1},
    }
    with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps(tf_config)}):
        workers.train(str(tmp_path / "b"), delete_checkpoint=False)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    "cluster_spec, task, writer",
    [
        ({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, {"type": "chief", "index": 0}, True),
        ({"chief": ["a:1"], "worker": ["b:1", "c:1"]}, {"type": "worker", "index": 0}, False),
        ({"worker": ["b:1", "c:1"]}, {"type": "worker", "index": 0}, True),
        ({"worker": ["b:1", "c:1"]}, {"type": "worker", "index": 1}, False),
        ({"worker": ["b:1"]}, {"type": "worker", "index": 0}, True),
        # An evaluator or ps never writes, even beside a single worker (ClusterSpec.is_writer).
        ({"worker": ["b:1"], "evaluator": ["e:1"]}, {"type": "evaluator", "index": 0}, False),
        ({"chief": ["a:1"], "ps": ["p:1"]}, {"type": "ps", "index": 0}, False),
    ],
)
def test_writer_is_chief_or_worker_0(cluster_spec, task, writer):
    import tensorflow as tf

    from tfscale.cluster import ClusterSpec

    environ = {"TF_CONFIG": json.dumps({"cluster": cluster_spec, "task": task})}
    spec = ClusterSpec.of_process(tf.distribute.get_strategy(), environ)
    assert (spec.is_writer, spec.task_label) == (writer, f"{task['type']}:{task['index']}")


def test_sigterm_in_process_backs_up_next_step_and_exits_75(tmp_path, reference):
    with pytest.raises(SystemExit) as exited:
        workers.train(str(tmp_path / "b"), save_freq=False, fail={"step": 9, "mode": "sigterm"})
    assert exited.value.code == tfscale.callbacks.RESTART_EXIT_CODE == 75
    assert backups(tmp_path / "b") == ["ckpt-000000000011"]  # noticed after step 10, saved after 11
    resumed = workers.train(str(tmp_path / "b"), save_freq=False)
    assert resumed["steps_run"] == TOTAL_STEPS - 11
    assert max_diff(resumed, reference()) <= 1e-6


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"backup_dir": ""}, r"`backup_dir`. Received: backup_dir=''"),
        ({"save_freq": 0}, r"`save_freq`. Received: save_freq=0. Expected either 'epoch'"),
        ({"save_freq": "batch"}, r"save_freq='batch'"),
        ({"double_checkpoint": 1}, r"`double_checkpoint`"),
        (
            {"double_checkpoint": True, "max_to_keep": 1},
            r"`max_to_keep`. Received: max_to_keep=1. Expected None or an integer >= 2",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    kwargs = {"backup_dir": "/tmp/x", **kwargs}
    with pytest.raises(tfscale.callbacks.BackupError, match=match):
        tfscale.callbacks.BackupAndRestore(**kwargs)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"step": 0}, "`step`. Received: step=0"),
        ({"step": 3, "mode": "explode"}, "`mode`"),
        ({"step": 3, "task": "w1"}, "`task`"),
        ({"step": 3, "restart_count": -1}, "`restart_count`. Received: restart_count=-1"),
    ],
)
def test_fail_at_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tfscale.callbacks.FailAt(**kwargs)


# --- real processes: SIGKILL / SIGTERM and restart the same script -------------------------


def run_script(config):
    """Runs the worker script once; returns (returncode, last finished global step, result or None)."""
    out = config["backup_dir"] + ".result.pkl"
    if os.path.exists(out):
        os.remove(out)
    proc = subprocess.run(
        [sys.executable, SCRIPT, json.dumps({**config, "out": out, "print_steps": True})],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
        timeout=180,
        check=False,
    )
    steps = [int(s) for s in re.findall(r"tfscale-test global_step (\d+)", proc.stdout)]
    result = None
    if os.path.exists(out):
        with open(out, "rb") as f:
            result = pickle.load(f)
    return proc.returncode, (steps[-1] if steps else 0), result, proc.stderr


@pytest.fixture(scope="module")
def subprocess_reference(tmp_path_factory):
    code, _, result, err = run_script({"backup_dir": str(tmp_path_factory.mktemp("sref") / "b")})
    assert code == 0, err
    return result


@pytest.mark.slow
@pytest.mark.parametrize("kill_step", [9, 16, 31])  # mid-epoch 0, epoch 0's last step, mid-epoch 1
def test_sigkill_then_restart_resumes_exactly(tmp_path, subprocess_reference, kill_step):
    config = {"backup_dir": str(tmp_path / "b")}
    code, last_step, _, _ = run_script({**config, "fail": {"step": kill_step, "mode": "sigkill"}})
    assert code == -9 and last_step == kill_step
    code, _, resumed, err = run_script(config)
    assert code == 0, err
    restored = resumed["restored"]["global_step"]
    assert 0 <= last_step - restored <= 5  # steps lost <= save_freq
    assert resumed["steps_run"] == TOTAL_STEPS - restored
    assert max_diff(resumed, subprocess_reference) <= 1e-6


@pytest.mark.slow
def test_sigterm_then_restart_loses_no_step(tmp_path, subprocess_reference):
    config = {"backup_dir": str(tmp_path / "b"), "save_freq": "epoch"}
    code, last_step, _, err = run_script({**config, "fail": {"step": 21, "mode": "sigterm"}})
    assert code == tfscale.callbacks.RESTART_EXIT_CODE, err
    assert "preemption backup" in err
    code, _, resumed, err = run_script(config)
    assert code == 0, err
    assert resumed["restored"]["global_step"] == last_step  # zero steps lost
    assert resumed["steps_run"] == TOTAL_STEPS - last_step
    assert max_diff(resumed, subprocess_reference) <= 1e-6


# --- a real 2-worker multi_worker cluster on loopback --------------------------------------


def cluster(backup_dir, **kwargs):
    return run_local_cluster(
        workers.cluster_train,
        num_workers=2,
        args=(backup_dir,),
        kwargs=kwargs,
        env={"TF_CPP_MIN_LOG_LEVEL": "2"},
        check=False,
        timeout=240,
        failure_grace=5,
    )


def finished_steps(log):
    steps = [int(s) for s in re.findall(r"tfscale-test global_step (\d+)", log)]
    return steps[-1] if steps else 0


@pytest.fixture(scope="module")
def cluster_reference(tmp_path_factory):
    ref = cluster(str(tmp_path_factory.mktemp("cref") / "b"))
    assert all(r.ok for r in ref), ref[0].log[-2000:]
    return ref


@pytest.mark.slow
def test_multi_worker_kill_one_worker_restart_all_resumes_exactly(tmp_path, cluster_reference):
    ref = cluster_reference
    backup_dir = str(tmp_path / "b")
    killed = cluster(
        backup_dir, fail={"step": 13, "mode": "sigkill", "task": ("worker", 1)}, print_steps=True
    )
    assert killed[1].returncode == -9 and not killed[0].ok
    # One writer, one complete backup (written in the background long before the kill at 13).
    assert listing(backup_dir) == ["ckpt-000000000010"]
    resumed = cluster(backup_dir)
    assert all(r.ok for r in resumed), resumed[1].log[-2000:]
    for r in (*killed, *resumed):  # variables read in one tf.function, not one eager collective each
        assert "eagerly has significant overhead" not in r.log, r.log[-2000:]
    restored = {r.value["restored"]["global_step"] for r in resumed}
    assert restored == {10}  # both workers restored the same backup
    for r, reference_run in zip(resumed, ref):
        assert r.value["steps_run"] == TOTAL_STEPS - 10
        assert max_diff(r.value, reference_run.value) <= 1e-6
        # Resumed in epoch 0: every epoch's loss, the interrupted one's included (sync-on-read).
        expected = reference_run.value["history"]["loss"]
        np.testing.assert_allclose(r.value["history"]["loss"], expected, rtol=0, atol=1e-6)
    assert not os.path.exists(backup_dir)  # deleted by the chief after success


@pytest.mark.slow
def test_multi_worker_sigterm_backs_up_same_step_on_all_workers(tmp_path, cluster_reference):
    backup_dir = str(tmp_path / "b")
    stopped = cluster(
        backup_dir,
        save_freq=False,
        fail={"step": 7, "mode": "sigterm", "task": ("worker", 1)},
        print_steps=True,
    )
    assert [r.returncode for r in stopped] == [75, 75], stopped[1].log[-2000:]
    last = {finished_steps(r.log) for r in stopped}
    assert len(last) == 1  # every worker stopped after the same step
    (step,) = last
    assert backups(backup_dir) == [f"ckpt-{step:012d}"]
    resumed = cluster(backup_dir, save_freq=False)
    assert all(r.ok for r in resumed), resumed[1].log[-2000:]
    for r, reference_run in zip(resumed, cluster_reference):
        assert r.value["restored"]["global_step"] == step  # zero steps lost
        assert r.value["steps_run"] == TOTAL_STEPS - step
        assert max_diff(r.value, reference_run.value) <= 1e-6


# --- deletes only what it wrote -----------------------------------------------------------------


def _plant_user_files(directory):
    """Files a user may keep beside the backups, including a folder named like one of them."""
    os.makedirs(directory / "ckpt-000000000999", exist_ok=True)
    files = {
        directory / "notes.txt": b"mine\n",
        directory / "ckpt-000000000999" / "state.npz": b"not tfscale's",
        directory / "ckpt-000000000999" / "README": b"also mine",
    }
    for path, data in files.items():
        path.write_bytes(data)
    return files


def test_user_files_in_backup_dir_survive_a_run_that_deletes_its_backups(tmp_path, caplog):
    backup_dir = tmp_path / "b"
    files = _plant_user_files(backup_dir)
    with caplog.at_level(logging.INFO, logger="tfscale"):
        with pytest.raises(tfscale.callbacks.InjectedFault):
            workers.train(str(backup_dir), fail={"step": 12, "mode": "raise"})
        resumed = workers.train(str(backup_dir))  # delete_checkpoint=True
    assert resumed["restored"]["global_step"] == 10  # the user's "ckpt-...999" was never a candidate
    assert {p: p.read_bytes() for p in files} == files
    assert sorted(os.listdir(backup_dir)) == ["ckpt-000000000999", "notes.txt"]
    assert re.search(r"also holds 2 entries tfscale did not write .*left untouched", caplog.text)


@pytest.mark.slow
def test_tfscale_train_with_backup_dir_equal_to_model_dir_keeps_user_files(tmp_path):
    from tfscale.datasets import digits

    data_dir = tmp_path / "tfds"
    digits.prepare(str(data_dir))
    shared = tmp_path / "run"
    files = _plant_user_files(shared)
    command = [
        sys.executable,
        "-m",
        "tfscale.train",
        "--epochs=1",
        "--steps_per_epoch=4",
        "--global_batch_size=64",
        "--seed=0",
    ]
    command += [
        f"--data_dir={data_dir}",
        f"--backup_dir={shared}",
        f"--model_dir={shared}",
        "--backup_freq=2",
    ]
    proc = subprocess.run(
        command,
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {p: p.read_bytes() for p in files} == files
    # The backups are gone; the user's files and TensorBoard logs are not.
    assert set(os.listdir(shared)) == {
        "ckpt-000000000999",
        "notes.txt",
        "model.keras",
        "summary.json",
        "logs",
    }


# --- restore is all or nothing --------------------------------------------------------------


def _rehash(backup):
    import hashlib

    manifest = json.loads((backup / "manifest.json").read_text())
    state = (backup / STATE).read_bytes()
    manifest["shards"][0].update(size=len(state), sha256=hashlib.sha256(state).hexdigest())
    (backup / "manifest.json").write_text(json.dumps(_backup_store.seal(manifest)))


def _keep_some_variables(backup, other):
    with np.load(backup / STATE) as npz:
        arrays = [npz[f"arr_{i}"] for i in range(len(npz.files))]
    np.savez(backup / STATE, *arrays[:2])
    _rehash(backup)


def _state_of_another_model(backup, other):
    (backup / STATE).write_bytes((other / STATE).read_bytes())
    _rehash(backup)


def _manifest_of_another_model(backup, other):
    manifest = json.loads((backup / "manifest.json").read_text())
    manifest["meta"] = json.loads((other / "manifest.json").read_text())["meta"]
    (backup / "manifest.json").write_text(json.dumps(manifest))


def _nest_manifest_200k_deep(backup, other):
    (backup / "manifest.json").write_text("[" * 200_000 + "]" * 200_000)


def _drop_global_step(backup, other):
    manifest = json.loads((backup / "manifest.json").read_text())
    del manifest["meta"]["global_step"]
    (backup / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def other_model_backup(tmp_path_factory):
    path = tmp_path_factory.mktemp("other")
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(path), units=32, fail={"step": 12, "mode": "raise"})
    return path / "ckpt-000000000010"


@pytest.mark.parametrize(
    "damage",
    [
        _keep_some_variables,  # restored silently (partly) before
        _state_of_another_model,  # an 8-line Keras error after some variables were assigned
        _manifest_of_another_model,
        _nest_manifest_200k_deep,  # RecursionError
        _drop_global_step,  # KeyError
    ],
)
def test_inconsistent_newest_backup_is_torn_and_falls_back(
    tmp_path, reference, caplog, other_model_backup, damage
):
    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(backup_dir), max_to_keep=2, fail={"step": 12, "mode": "raise"})
    damage(backup_dir / "ckpt-000000000010", other_model_backup)
    with caplog.at_level(logging.WARNING, logger="tfscale"):
        resumed = workers.train(str(backup_dir), max_to_keep=2)
    assert "ckpt-000000000010 is unusable" in caplog.text
    assert resumed["restored"]["global_step"] == 5
    assert resumed["steps_run"] == TOTAL_STEPS - 5
    assert max_diff(resumed, reference()) <= 1e-6


def test_mismatch_found_late_assigns_no_variable(tmp_path):
    """A backup whose last variable has another name: refused in one line, nothing assigned."""
    import tfscale.strategies

    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(backup_dir), fail={"step": 12, "mode": "raise"})
    settle(backup_dir)
    manifest_path = backup_dir / "ckpt-000000000010" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["meta"]["optimizer_variables"][-1][0] = "adam/renamed"
    manifest_path.write_text(json.dumps(_backup_store.seal(manifest)))
    strategy = tfscale.strategies.get("one_device")
    model = workers.build_model(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
    callback = tfscale.callbacks.BackupAndRestore(str(backup_dir), save_freq=5)
    with pytest.raises(tfscale.callbacks.BackupMismatchError, match="'adam/renamed'") as raised:
        model.fit(**workers.make_data("array", 8), epochs=1, callbacks=[callback], verbose=0)
    assert len(str(raised.value).splitlines()) == 1
    after = [v.numpy() for v in model.variables + model.optimizer.variables]
    assert all(np.array_equal(a, b) for a, b in zip(before, after))


# --- full, read-only and unusable file systems ------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 256 KiB tmpfs mounted for this test only (needs root), always unmounted."""
    mount_point = tmp_path / f"tmpfs-{os.getpid()}"
    mount_point.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount_point)],
        check=False,
        capture_output=True,
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def _fill_disk_after(step, directory, backup_dir=None):
    import keras

    class FillDisk(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if int(self.model.optimizer.iterations.numpy()) == step:
                # With background writes: wait (bounded) until no write is in flight and the
                # one before is pruned, else that write or prune could free the space again.
                # The directory also holds tfscale's `.tfscale-lock`: count only checkpoints.
                deadline = time.monotonic() + 60
                while backup_dir is not None:
                    names = os.listdir(backup_dir) if os.path.isdir(backup_dir) else []
                    written = [n for n in names if n.startswith("ckpt-")]
                    if len(written) == 1 and not any(n.startswith(".tmp-") for n in names):
                        break
                    assert time.monotonic() < deadline, f"backup writes never settled: {names}"
                    time.sleep(0.01)
                with open(directory / "filler", "wb", buffering=0) as f:
                    try:
                        while True:
                            f.write(b"\0" * 4096)
                    except OSError:
                        pass  # full

    return FillDisk()


def _fit(backup_dir, callbacks, epochs=3, **kwargs):
    import tfscale.strategies

    model = workers.build_model(tfscale.strategies.get("one_device"))
    backup = tfscale.callbacks.BackupAndRestore(str(backup_dir), save_freq=5, **kwargs)
    model.fit(**workers.make_data("array", 8), epochs=epochs, callbacks=[backup, *callbacks], verbose=0)
    return backup


def test_full_disk_keeps_last_backup_leaves_no_temp_and_names_the_path(small_tmpfs):
    backup_dir = small_tmpfs / "b"
    with pytest.raises(tfscale.callbacks.BackupWriteError) as raised:
        _fit(backup_dir, [_fill_disk_after(7, small_tmpfs)])
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert re.search(rf"step 10 to '{backup_dir}/\.tmp-ckpt-0+10-.*No space left on device", message)
    assert "last backup is kept" in message and "ckpt-000000000005" in message
    assert listing(backup_dir) == ["ckpt-000000000005"]
    os.remove(small_tmpfs / "filler")
    resumed = _fit(backup_dir, [], delete_checkpoint=False)
    assert resumed.restored_from["global_step"] == 5


def test_read_only_backup_dir_is_one_line_error(small_tmpfs):
    backup_dir = small_tmpfs / "b"
    _fit(backup_dir, [], epochs=1, delete_checkpoint=False)
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    with pytest.raises(
        tfscale.callbacks.BackupWriteError, match=r"^Cannot write to `backup_dir=.*read-only[^\n]*$"
    ):
        _fit(backup_dir, [])


# --- SIGTERM after a fit that raised ------------------------------------------------------------

_SIGTERM_CHILD = """
import os, sys, time
sys.path.insert(0, {tests!r})
import _backup_workers as workers
import tfscale.callbacks

for _ in range({failed_fits}):
    try:
        workers.train({backup_dir!r}, fail={{"step": 6, "mode": "raise"}})
    except tfscale.callbacks.InjectedFault:
        pass
if {then_preempted}:
    workers.train({backup_dir!r}, save_freq=False, fail={{"step": 9, "mode": "sigterm"}})
print("ready", flush=True)
time.sleep(60)
print("still alive", flush=True)
"""


@pytest.mark.parametrize("failed_fits", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sigterm_ends_the_process_after_a_fit_that_raised(tmp_path, failed_fits):
    import signal

    code = _SIGTERM_CHILD.format(
        tests=os.path.dirname(__file__),
        failed_fits=failed_fits,
        backup_dir=str(tmp_path / "b"),
        then_preempted=False,
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    with subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM


@pytest.mark.slow
def test_preemption_still_saves_in_a_fit_after_one_that_raised(tmp_path):
    code = _SIGTERM_CHILD.format(
        tests=os.path.dirname(__file__), failed_fits=1, backup_dir=str(tmp_path / "b"), then_preempted=True
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=300
    )
    assert proc.returncode == tfscale.callbacks.RESTART_EXIT_CODE, proc.stderr[-2000:]
    assert backups(tmp_path / "b") == ["ckpt-000000000011"]


# --- hostile inputs: one line each ------------------------------------------------------------------


def _bad_constructor_inputs():
    """Generated wrong-type, empty, huge and odd values for each argument."""
    odd = [None, 0, 1.5, -1, b"/tmp/x", ["/tmp/x"], {}, float("nan"), object()]
    for value in [*odd, "", "a\0b"]:
        yield {"backup_dir": value}, "backup_dir"
    for value in [*odd, True, 0, -5, "Epoch", "", "10", 2.0]:
        yield {"save_freq": value}, "save_freq"
    for name in ("double_checkpoint", "delete_checkpoint", "save_before_preemption", "async_save"):
        for value in (None, 0, 1, "True", []):
            yield {name: value}, name
    for value in (0, -1, "2", True, 1.0):
        yield {"max_to_keep": value}, "max_to_keep"


BAD_CONSTRUCTOR_INPUTS = list(_bad_constructor_inputs())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    BAD_CONSTRUCTOR_INPUTS,
    # No memory address in an id: both xdist workers must collect the same names.
    ids=[re.sub(r" at 0x[0-9a-f]+", "", repr(k))[:40] for k, _ in BAD_CONSTRUCTOR_INPUTS],
)
def test_hostile_constructor_input_is_one_line_naming_the_argument(kwargs, name):
    kwargs = {"backup_dir": "/tmp/x", **kwargs}
    with pytest.raises(tfscale.callbacks.BackupError) as raised:
        tfscale.callbacks.BackupAndRestore(**kwargs)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert message.startswith(f"Invalid value for argument `{name}`. Received: {name}=")


def _unusable_backup_dirs(tmp_path):
    (tmp_path / "a_file").write_text("x")
    yield tmp_path / "a_file", r"exists and is not a directory"
    yield tmp_path / "a_file" / "below", r"Cannot create `backup_dir=.*Not a directory"
    yield tmp_path / ("n" * 300), r"Cannot create `backup_dir=.*File name too long"
    yield tmp_path / ("x" * 200) / ("y" * 200) / ("z" * 4000), r"Cannot create `backup_dir=.*too long"


def test_hostile_backup_dirs_at_fit_are_one_line_errors(tmp_path):
    cases = list(_unusable_backup_dirs(tmp_path))
    for path, match in cases:
        with pytest.raises(tfscale.callbacks.BackupWriteError, match=match) as raised:
            _fit(path, [], epochs=1)
        assert len(str(raised.value).splitlines()) == 1, path
    assert (tmp_path / "a_file").read_text() == "x"


def test_non_ascii_backup_dir_works(tmp_path):
    backup_dir = tmp_path / "données-日本-\u00e9\u0301"
    _fit(backup_dir, [], epochs=1, delete_checkpoint=False)
    assert backups(backup_dir) == ["ckpt-000000000015"]
