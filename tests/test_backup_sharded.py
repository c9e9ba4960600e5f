"""Sharded backups: one shard per device of this process, one per other task, all verified.

The fast tests pipeline a model over two logical CPUs of this process (one `.npz` shard
each); the `slow` ones run a real two-task TensorFlow cluster (`_backup_remote.py`) whose
second layer lives on task 1, so its shard is written by ops placed on task 1.
"""

import hashlib
import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
from _backup_workers import flip_byte

import tfscale.callbacks
import tfscale.strategies
from tfscale.callbacks import _backup_store, _backup_writer
from tfscale.launch._procs import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))
SAVE_FREQ, FAIL_STEP = 4, 10  # backups at 4 and 8; the run fails after step 10


def _pipelined_model():
    keras.utils.set_random_seed(5)
    model = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(12, activation="relu"), keras.layers.Dense(3)], name="mlp"
    )
    strategy = tfscale.strategies.get("pipeline", num_stages=2, num_microbatches=2, balance="uniform")
    model = strategy.wrap(model)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _built(model):
    with model.distribute_strategy.scope():  # as the callback builds it, slots beside their variables
        model.optimizer.build(model.trainable_variables)
    return model


def _state(model):
    return [v.numpy() for v in model.variables + model.optimizer.variables]


def _train(backup_dir, fail=False, **options):
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(64, 6)).astype("float32"), rng.normal(size=(64, 3)).astype("float32")
    model = _pipelined_model()
    options = {"max_to_keep": 2, **options}
    backup = tfscale.callbacks.BackupAndRestore(
        str(backup_dir), save_freq=SAVE_FREQ, delete_checkpoint=False, **options
    )
    callbacks = [backup, tfscale.callbacks.FailAt(FAIL_STEP, mode="raise")] if fail else [backup]
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=callbacks)
    return model, backup


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The state after an uninterrupted run."""
    model, _ = _train(tmp_path_factory.mktemp("reference") / "b")
    return _state(model)


def _interrupted(tmp_path, **options):
    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        _train(backup_dir, fail=True, **options)
    _backup_writer.wait_for_directory(str(backup_dir))  # a write in flight when `fit` raised
    return backup_dir


def _manifest(backup):
    return json.loads((backup / "manifest.json").read_text())


def _assert_equal(state, reference):
    assert len(state) == len(reference)
    for a, b in zip(state, reference):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("async_save", [False, True])
def test_pipelined_model_is_backed_up_one_shard_per_device_and_resumes_exactly(
    tmp_path, reference, async_save
):
    backup_dir = _interrupted(tmp_path, async_save=async_save)
    newest = _backup_store.BackupStore(str(backup_dir), 2).published()[0]
    step = int(newest.split("-")[1])  # 8; with async_save, snapshots come earlier (at most 4 at risk)
    assert step == 8 if not async_save else FAIL_STEP - SAVE_FREQ <= step <= FAIL_STEP
    shards = _manifest(backup_dir / newest)["shards"]
    model = _built(_pipelined_model())
    # What a backup holds, in order: the model's, the optimizer's and the metrics' variables.
    variables = model.variables + model.optimizer.variables + model.metrics_variables
    devices = {v.value.device for v in variables}
    assert len(devices) == 2 and [s["kind"] for s in shards] == ["npz", "npz"]
    assert {s["device"] for s in shards} == devices
    for shard in shards:  # each shard holds exactly the variables of its device
        assert shard["variables"] == [i for i, v in enumerate(variables) if v.value.device == shard["device"]]
        assert (backup_dir / newest / shard["file"]).is_file()
    resumed, backup = _train(backup_dir)
    assert backup.restored_from["global_step"] == step
    _assert_equal(_state(resumed), reference)


@pytest.mark.parametrize("damage", [flip_byte, os.remove], ids=["corrupted", "missing"])
def test_damaged_shard_falls_back_to_the_previous_backup(tmp_path, reference, caplog, damage):
    backup_dir = _interrupted(tmp_path)
    damage(str(backup_dir / "ckpt-000000000008" / "shard-00001.npz"))
    resumed, backup = _train(backup_dir)
    assert "ckpt-000000000008 is unusable" in caplog.text
    assert backup.restored_from["global_step"] == 4
    _assert_equal(_state(resumed), reference)


def test_damaged_second_shard_assigns_nothing_from_the_first(tmp_path):
    """All or nothing: every shard is verified before the first variable is assigned."""
    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        _train(backup_dir, fail=True, max_to_keep=1)
    flip_byte(str(backup_dir / "ckpt-000000000008" / "shard-00001.npz"))
    model = _built(_pipelined_model())
    before = _state(model)
    backup = tfscale.callbacks.BackupAndRestore(str(backup_dir))
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")
    with pytest.raises(tfscale.callbacks.UnusableBackupError, match="all 1 are torn or corrupt"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[backup])
    _assert_equal(_state(model), before)  # shard-00000 (intact) was not assigned either


@pytest.mark.slow  # 14 s; the format-2 restore tests stay in the fast tier
def test_format_1_backup_still_restores_exactly(tmp_path, reference):
    """A backup from before sharding (one state.npz, "files" in the manifest) resumes."""
    backup_dir = _interrupted(tmp_path)
    backup = backup_dir / "ckpt-000000000008"
    manifest = _manifest(backup)
    arrays = {}
    for shard in manifest["shards"]:
        with np.load(backup / shard["file"]) as npz:
            arrays.update(zip(shard["variables"], (npz[f"arr_{i}"] for i in range(len(npz.files)))))
        os.remove(backup / shard["file"])
    np.savez(backup / "state.npz", *(arrays[i] for i in range(len(arrays))))
    state = (backup / "state.npz").read_bytes()
    digest = {"size": len(state), "sha256": hashlib.sha256(state).hexdigest()}
    old = {"format": 1, "meta": manifest["meta"], "files": {"state.npz": digest}}
    (backup / "manifest.json").write_text(json.dumps(old))
    resumed, restored = _train(backup_dir)
    assert restored.restored_from["global_step"] == 8
    _assert_equal(_state(resumed), reference)


def _run_cluster(tmp_path, **options):
    """Task 1 serves, task 0 trains, fails, resumes; the client's JSON result."""
    script = os.path.join(HERE, "_backup_remote.py")
    ports = [str(p) for p in free_ports(2)]
    with subprocess.Popen(
        [sys.executable, script, "server", *ports],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as server:
        try:
            assert "ready" in server.stdout.readline()
            options = {"backup_dir": str(tmp_path / "b"), "async_save": False, **options}
            client = subprocess.run(
                [sys.executable, script, "client", *ports, json.dumps(options)],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
        finally:
            server.kill()
    lines = [line for line in client.stdout.splitlines() if line.startswith("tfscale-test ")]
    assert client.returncode == 0 and lines, client.stderr[-3000:]
    return json.loads(lines[-1][len("tfscale-test ") :])


REMOTE = "/job:worker/replica:0/task:1/device:CPU:0"
LOCAL = "/job:worker/replica:0/task:0/device:CPU:0"


@pytest.mark.slow
def test_variables_on_another_task_are_written_there_and_resume_exactly(tmp_path):
    result = _run_cluster(tmp_path, async_save=True)
    assert result["devices"] == [LOCAL, REMOTE]
    assert [(s["kind"], s["device"]) for s in result["shards"]] == [("npz", LOCAL), ("tensors", REMOTE)]
    # The remote shard's WriteFile op ran on task 1 (its bytes never reached task 0) and
    # the file is there (on loopback both tasks share the disk).
    assert result["written_on"] == [REMOTE] and result["placed_files_exist"] == [True]
    assert result["restored_step"] == result["newest_step"] and 10 - 4 <= result["newest_step"] <= 10
    assert result["max_diff"] == 0.0  # the same as an uninterrupted run


@pytest.mark.slow
def test_corrupted_shard_on_another_task_falls_back_to_the_previous_backup(tmp_path):
    result = _run_cluster(tmp_path, damage_remote=True)
    assert result["restored_step"] == 4  # its fingerprint, computed on task 1, did not match
    assert result["max_diff"] == 0.0


def test_backup_of_an_unknown_format_is_refused_with_what_to_do(tmp_path):
    store = _backup_store.BackupStore(str(tmp_path), max_to_keep=1)
    store.write(4, {"step": 4}, [_backup_store.NpzShard("/cpu:0", [0], [np.zeros(3)])])
    manifest_path = tmp_path / "ckpt-000000000004" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    newer = _backup_store.FORMAT_VERSION + 1
    manifest_path.write_text(json.dumps({**manifest, "format": newer, "parts": manifest.pop("shards")}))
    with pytest.raises(_backup_store.UnusableBackupError, match=rf"format {newer}, .*by a newer tfscale"):
        store.load("ckpt-000000000004")
