"""Hostile `backup_dir`s for `BackupAndRestore`: tampered manifests, foreign entries, two jobs.

The cases are generated, family by family, each under a time bound (`pytest-timeout`: a
read that blocked on a FIFO or never ended on `/dev/zero` fails the test instead of
hanging it):

- tampering: every field of a real manifest, changed without resealing (its sha256 must
  refuse it), and every position field of the metadata set out of range and resealed (the
  range checks must refuse it before any variable is assigned);
- foreign entries: every kind of entry tfscale did not write, put in a `backup_dir` a real
  training uses: training resumes and ends exactly as without them, every one of them is
  left as it was, and they cost one log line at most;
- two jobs on one folder: a live holder refuses the second job in one line naming it,
  before anything in the folder is read or changed; a SIGKILLed holder is taken over; a
  different `job_id`'s backups are refused in one line.
"""

import copy
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time

import _backup_workers as workers
import numpy as np
import pytest

import tfscale.callbacks
from tfscale.callbacks import _backup_store

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_foreign_entries_are_left_alone_and_cost_one_line_at_most": 1,
}

TOTAL_STEPS = 48


class _Stop(Exception):
    pass


def _stop_after_restore():
    import keras

    class StopAfterRestore(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            raise _Stop()

    return StopAfterRestore()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A backup_dir with two backups (steps 20 and 25) of an interrupted run, and its reference."""
    root = tmp_path_factory.mktemp("pristine")
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(root / "b"), max_to_keep=2, fail={"step": 27, "mode": "raise"})
    reference = workers.train(str(root / "ref"))
    return root / "b", reference


def _leaves(value, path=()):
    """Every (path, value) leaf of a JSON value (lists: first and last element only)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, (*path, key))
    elif isinstance(value, list) and value:
        for index in sorted({0, len(value) - 1}):
            yield from _leaves(value[index], (*path, index))
    else:
        yield path, value


def _set(manifest, path, value):
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2 + 1
    if isinstance(value, str):
        return value + "x"
    return 0


NEWEST = "ckpt-000000000025"


@pytest.mark.timeout(120)
def test_every_manifest_field_edited_without_its_checksum_is_refused(pristine, tmp_path):
    backup_dir, _ = pristine
    manifest = json.loads((backup_dir / NEWEST / "manifest.json").read_text())
    leaves = [p for p, _ in _leaves(manifest) if p != ("sha256",)]
    assert len(leaves) > 25
    store = _backup_store.BackupStore(str(tmp_path), max_to_keep=2)
    for path in leaves:
        shutil.rmtree(tmp_path / NEWEST, ignore_errors=True)
        shutil.copytree(backup_dir / NEWEST, tmp_path / NEWEST)
        edited = copy.deepcopy(manifest)
        target = edited
        for key in path[:-1]:
            target = target[key]
        for change in (lambda t, k: t.__setitem__(k, _changed(t[k])), lambda t, k: t.pop(k)):
            attempt = copy.deepcopy(edited)
            inner = attempt
            for key in path[:-1]:
                inner = inner[key]
            change(inner, path[-1])
            (tmp_path / NEWEST / "manifest.json").write_text(json.dumps(attempt))
            with pytest.raises(_backup_store.UnusableBackupError):
                store.load(NEWEST)
    # The same-shape swap of the issue: two variable indices of one shard exchanged.
    swapped = copy.deepcopy(manifest)
    indices = swapped["shards"][0]["variables"]
    indices[0], indices[1] = indices[1], indices[0]
    (tmp_path / NEWEST / "manifest.json").write_text(json.dumps(swapped))
    with pytest.raises(_backup_store.UnusableBackupError, match="own sha256"):
        store.load(NEWEST)


def _out_of_range_cases():
    fields = [
        ("epoch",),
        ("step",),
        ("global_step",),
        ("input", "iterators_made"),
        ("input", "batches_taken"),
    ]
    values = [-1, 10**6, 10**18, 1.5, "3", None, True, [1]]
    for field in fields:
        for value in values:
            yield ("meta", *field), value
    for value in (-1, 10**15, "1"):
        yield ("shards", 0, "size"), value
    for value in ("../../etc/passwd", "manifest.json", "shard-00000.pickle", 7):
        yield ("shards", 0, "file"), value
    yield ("shards", 0, "kind"), "pickle"
    yield ("shards", 0, "variables"), [0, 0]
    yield ("shards", 0, "variables"), [10**9]
    yield ("meta", "model"), []
    yield ("meta", "optimizer"), "SGD"
    yield ("meta", "job_id"), "someone-else"
    yield ("format",), 99


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_position_field_out_of_range_and_resealed_is_refused_before_any_assignment(pristine, tmp_path):
    """Resealed (so the checksum passes): the range checks alone must hold. Each case ends in
    a one-line tfscale.Error with no variable assigned, or falls back to the previous backup."""
    import tfscale.strategies

    backup_dir, _ = pristine
    manifest = json.loads((backup_dir / NEWEST / "manifest.json").read_text())
    strategy = tfscale.strategies.get("one_device")
    model = workers.build_model(strategy)
    with strategy.scope():
        model.optimizer.build(model.trainable_variables)
    counts = {"refused": 0, "fell back": 0}
    for path, value in _out_of_range_cases():
        work = tmp_path / "b"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(backup_dir, work)
        edited = copy.deepcopy(manifest)
        _set(edited, path, value)
        (work / NEWEST / "manifest.json").write_text(json.dumps(_backup_store.seal(edited)))
        before = [v.numpy().copy() for v in model.variables + model.optimizer.variables]
        callback = tfscale.callbacks.BackupAndRestore(str(work), save_freq=5, max_to_keep=2)
        try:
            model.fit(**workers.make_data("array", 8), epochs=3, callbacks=[callback, _stop_after_restore()],
                      verbose=0)  # fmt: skip
        except tfscale.errors.Error as e:
            assert "\n" not in str(e), (path, value, str(e))
            after = [v.numpy() for v in model.variables + model.optimizer.variables]
            assert all(np.array_equal(a, b) for a, b in zip(before, after)), (path, value)
            counts["refused"] += 1
        except _Stop:
            assert callback.restored_from["global_step"] == 20, (path, value, callback.restored_from)
            counts["fell back"] += 1
    print(f"tampered and resealed: {counts}")
    assert sum(counts.values()) == len(list(_out_of_range_cases()))


# --- foreign entries ------------------------------------------------------------------------


def _foreign_kinds(root, elsewhere):
    """{kind: make(backup_dir)}: entries tfscale did not write, named like its own where that hurts."""

    def empty_dirs(d, n=1, step=999):
        for i in range(n):
            os.mkdir(d / f"ckpt-{step + i:012d}")

    def with_user_file(d):
        os.mkdir(d / "ckpt-000000000999")
        (d / "ckpt-000000000999" / "notes.txt").write_text("mine\n")

    def shard_named_dir(d):  # the case: a directory where a shard file would be
        os.makedirs(d / "ckpt-000000000001" / "shard-00000.npz")

    def regular_file(d):
        (d / "ckpt-000000000999").write_text("a file, not a backup\n")

    def fifo_named_like_a_backup(d):
        os.mkfifo(d / "ckpt-000000000999")

    def fifo_manifest(d):
        os.mkdir(d / "ckpt-000000000999")
        os.mkfifo(d / "ckpt-000000000999" / "manifest.json")

    def manifest_to_dev_zero(d):
        os.mkdir(d / "ckpt-000000000999")
        os.symlink("/dev/zero", d / "ckpt-000000000999" / "manifest.json")

    def symlink_to_a_backup_elsewhere(d):
        os.symlink(elsewhere, d / "ckpt-000000000999")

    def temp_named_dir(d):
        os.mkdir(d / ".tmp-ckpt-000000000003-1-abcdef12")
        (d / ".tmp-ckpt-000000000003-1-abcdef12" / "data.bin").write_bytes(b"\0" * 10)

    def lock_named_dir(d):
        os.mkdir(d / "rejected-ckpt-000000000002-00000000x")

    return {
        "empty ckpt dir": empty_dirs,
        "3000 empty ckpt dirs": lambda d: empty_dirs(d, 3000, step=1000),
        "ckpt dir with a user file": with_user_file,
        "shard name is a directory": shard_named_dir,
        "regular file named ckpt": regular_file,
        "FIFO named ckpt": fifo_named_like_a_backup,
        "FIFO manifest": fifo_manifest,
        "manifest symlink to /dev/zero": manifest_to_dev_zero,
        "symlink to another backup": symlink_to_a_backup_elsewhere,
        "temp-named dir with user data": temp_named_dir,
        "near-miss rejected name": lock_named_dir,
    }


def _state(root):
    """lstat type, size and (for regular files) bytes of everything under `root` (no link followed)."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(d, name)
            st = os.lstat(path)
            data = open(path, "rb").read() if stat.S_ISREG(st.st_mode) else None
            out[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), st.st_size, data)
    return out


@pytest.fixture(scope="module")
def elsewhere(pristine, tmp_path_factory):
    """A published backup of the same model outside the backup_dir (a symlink target)."""
    path = tmp_path_factory.mktemp("elsewhere") / "ckpt-000000000025"
    shutil.copytree(pristine[0] / NEWEST, path)
    return path


# The fast tier keeps the cases; the rest run with the slow tier.
_FAST_FOREIGN = {
    "3000 empty ckpt dirs",
    "shard name is a directory",
    "FIFO manifest",
    "manifest symlink to /dev/zero",
}


def _foreign_cases():
    return [
        pytest.param(kind, marks=() if kind in _FAST_FOREIGN else pytest.mark.slow)
        for kind in _foreign_kinds(None, None)
    ]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", _foreign_cases())
def test_foreign_entries_are_left_alone_and_cost_one_line_at_most(
    kind, pristine, elsewhere, tmp_path, caplog
):
    _, reference = pristine
    backup_dir = tmp_path / "b"
    backup_dir.mkdir()
    _foreign_kinds(tmp_path, str(elsewhere))[kind](backup_dir)
    before = _state(backup_dir)
    start = time.monotonic()
    with caplog.at_level(logging.INFO, logger="tfscale"):
        with pytest.raises(tfscale.callbacks.InjectedFault):
            workers.train(str(backup_dir), fail={"step": 22, "mode": "raise"})
        resumed = workers.train(str(backup_dir))
    seconds = time.monotonic() - start
    assert resumed["restored"]["global_step"] == 20, kind
    assert resumed["steps_run"] == TOTAL_STEPS - 20
    assert workers_max_diff(resumed, reference) <= 1e-6
    after = _state(backup_dir)
    assert {k: v for k, v in after.items() if k in before} == before, kind
    assert set(after) == set(before), (kind, set(after) ^ set(before))  # delete_checkpoint took ours only
    noted = [r for r in caplog.records if "did not write" in r.getMessage() or "unusable" in r.getMessage()]
    assert len(noted) <= 2, (kind, [r.getMessage()[:200] for r in noted])  # one per fit, at most
    assert not any("moved backup" in r.getMessage() for r in caplog.records), kind
    assert seconds < 120, (kind, seconds)


@pytest.mark.timeout(120)
def test_a_foreign_entry_where_a_backup_goes_is_one_line_and_left_alone(tmp_path):
    backup_dir = tmp_path / "b"
    (backup_dir / "ckpt-000000000010").mkdir(parents=True)
    with pytest.raises(tfscale.callbacks.BackupWriteError, match=r"step 10 .*did not write") as raised:
        workers.train(str(backup_dir))
    assert "\n" not in str(raised.value)
    assert os.path.isdir(backup_dir / "ckpt-000000000010")
    assert workers.listing(backup_dir) == ["ckpt-000000000005", "ckpt-000000000010"]


def workers_max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a["weights"], b["weights"]))


# --- two jobs on one folder ---------------------------------------------------------------------

_HOLDER = """
import fcntl, json, os, socket, sys, time

fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.ftruncate(fd, 0)
os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job_id": "job-a",
                         "since": time.time()}).encode())
print("held", flush=True)
time.sleep(600)
"""


@pytest.fixture
def holder(tmp_path):
    """A live process holding `backup_dir`'s lock as a tfscale job would (killed at the end)."""
    procs = []

    def start(backup_dir):
        proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(backup_dir / ".tfscale-lock")],
                                stdout=subprocess.PIPE, text=True)  # fmt: skip
        procs.append(proc)
        assert proc.stdout.readline() == "held\n"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(timeout=30)


@pytest.mark.timeout(240)
def test_a_second_live_job_fails_before_its_first_step_naming_the_holder(pristine, holder, tmp_path):
    backup_dir = tmp_path / "b"
    shutil.copytree(pristine[0], backup_dir)
    proc = holder(backup_dir)
    before = _state(backup_dir)
    counter = workers.step_counter()
    with pytest.raises(tfscale.callbacks.BackupInUseError) as raised:
        workers.train(str(backup_dir), job_id="job-b")
    message = str(raised.value)
    assert "\n" not in message and f"pid {proc.pid} on " in message and "'job-a'" in message, message
    assert counter.steps == 0
    assert _state(backup_dir) == before  # nothing read into the model, moved or pruned
    # The holder dies (SIGKILL: no cleanup): the lock is provably free, the restart takes it over.
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    resumed = workers.train(str(backup_dir))
    assert resumed["restored"]["global_step"] == 25
    assert workers_max_diff(resumed, pristine[1]) <= 1e-6


@pytest.mark.timeout(240)
def test_another_jobs_leftovers_are_refused_in_one_line(pristine, tmp_path):
    backup_dir = tmp_path / "b"
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(str(backup_dir), job_id="job-a", fail={"step": 12, "mode": "raise"})
    before = _state(backup_dir)
    for other in ("job-b", None):
        with pytest.raises(tfscale.callbacks.BackupInUseError, match=r"belongs to job_id='job-a'") as raised:
            workers.train(str(backup_dir), job_id=other)
        assert "\n" not in str(raised.value)
        assert _state(backup_dir) == before
    resumed = workers.train(str(backup_dir), job_id="job-a")
    assert resumed["restored"]["global_step"] == 10 and resumed["restored"]["job_id"] == "job-a"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_real_jobs_on_one_folder(tmp_path):
    """Job A (a real process, slowed) holds the folder; job B fails in one line; A, SIGKILLed and
    restarted, resumes its own backups exactly; B's own run elsewhere is untouched."""
    backup_dir = tmp_path / "b"
    out = tmp_path / "a.pkl"
    config = {"backup_dir": str(backup_dir), "out": str(out), "job_id": "job-a", "slow_step": 0.2,
              "print_steps": True}  # fmt: skip
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.Popen([sys.executable, workers.__file__, json.dumps(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=env)  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("tfscale-test global_step 12"):
                break
        else:
            raise AssertionError(f"job A ended before step 12 (exit {proc.wait(timeout=60)})")
        # Paused, not finished: under load job A's last 36 steps (7 s) could otherwise end, and
        # free the folder, before job B (starting TensorFlow's fit) reaches the lock.
        os.kill(proc.pid, signal.SIGSTOP)
        before = _state(backup_dir)
        with pytest.raises(tfscale.callbacks.BackupInUseError, match=rf"pid {proc.pid} on .*'job-a'"):
            workers.train(str(backup_dir), job_id="job-b")
        assert set(_state(backup_dir)) >= {k for k in before if not k.startswith(".tmp-")}
    finally:
        proc.kill()
        proc.wait(timeout=60)
    reference = workers.train(str(tmp_path / "ref"))
    resumed = workers.train(str(backup_dir), job_id="job-a")
    assert resumed["restored"]["global_step"] >= 10
    assert workers_max_diff(resumed, reference) <= 1e-6


def test_tfscale_launch_gives_its_tasks_one_job_id_per_command_line(monkeypatch):
    from tfscale.launch import jobs

    monkeypatch.setattr(sys, "argv", ["tfscale-launch", "--", "python", "train.py", "--seed=1"])
    first = [jobs.task_env("{}", False, {}, attempt)[jobs.JOB_ID_VAR] for attempt in range(3)]
    assert len(set(first)) == 1 and first[0].startswith("launch-")  # every attempt: the same job
    monkeypatch.setattr(sys, "argv", ["tfscale-launch", "--", "python", "train.py", "--seed=2"])
    assert jobs.task_env("{}", False, {}, 0)[jobs.JOB_ID_VAR] != first[0]  # another job
    assert jobs.task_env("{}", False, {jobs.JOB_ID_VAR: "mine"}, 0)[jobs.JOB_ID_VAR] == "mine"
    assert tfscale.callbacks.backup_and_restore.JOB_ID_VAR == jobs.JOB_ID_VAR
