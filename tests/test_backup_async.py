"""`BackupAndRestore(async_save=True)`: the write leaves the training thread, the guarantees stay.

Writes are slowed down on purpose (a real sleep in the real store's write) so that the
steps after a backup run while it is in flight.
"""

import os
import re

import _backup_workers as workers
import numpy as np
import pytest
from test_backup_and_restore import TOTAL_STEPS, _fill_disk_after, _fit, max_diff, reference, small_tmpfs

import tfscale.callbacks
from tfscale.callbacks import _backup_store

__all__ = ["reference", "small_tmpfs"]  # fixtures used here


def _record_each_step(backup_dir):
    """Weights after each step, and the newest backup published on disk at that moment."""
    import keras

    store = _backup_store.BackupStore(backup_dir, 100)

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.weights, self.published = {}, {}

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            self.weights[step] = [v.value.numpy().copy() for v in self.model.variables]
            names = store.published()
            self.published[step] = int(names[0].split("-")[1]) if names else 0

    return Record()


@pytest.mark.parametrize(
    ("write_seconds", "step_seconds", "save_freq"),
    [
        (0.03, 0.01, 10),  # a write takes ~3 steps of 10: it overlaps them
        (0.05, 0.0, 5),  # a write takes more than 5 steps: each backup waits for its write
    ],
    ids=["overlapping", "slower-than-save_freq"],
)
@pytest.mark.slow  # 17 s; fast tier: the raise-mid-write and early-snapshot resumes below write async too
def test_writes_off_the_training_thread_from_a_copy_and_never_more_than_save_freq_steps_at_risk(
    tmp_path, write_seconds, step_seconds, save_freq
):
    import tfscale.strategies

    writes = []
    model = workers.build_model(tfscale.strategies.get("one_device"))
    backup = workers.slow_backup_class(write_seconds, writes, step_seconds)(
        str(tmp_path / "b"), save_freq=save_freq, max_to_keep=100, delete_checkpoint=False, async_save=True
    )
    record = _record_each_step(backup.backup_dir)
    model.fit(**workers.make_data("array", 8), epochs=3, callbacks=[backup, record], verbose=0)
    # After every step, a kill before the next one ends loses at most save_freq steps: the
    # newest published backup is never more than save_freq steps behind the step about to
    # run (snapshots every save_freq steps would leave up to save_freq - 1 + the steps a
    # write takes at risk).
    at_risk = {step: step + 1 - published for step, published in record.published.items()}
    assert max(at_risk.values()) <= save_freq and sorted(at_risk) == list(range(1, TOTAL_STEPS + 1))
    steps = [s for s, _ in writes]
    assert all(name == "tfscale-backup-writer" for _, name in writes)
    assert steps == sorted(set(steps)) and steps[0] == save_freq - save_freq // 2  # the first one early
    if step_seconds:
        # Writes ran while steps ran: after some snapshot's next step, it was still unpublished.
        assert any(record.published[s + 1] < s for s in steps if s < TOTAL_STEPS)
    else:
        assert backup._writer.waits > 0  # 5 steps take less than a 50 ms write: the step waited
    store = _backup_store.BackupStore(backup.backup_dir, 100)
    assert store.published() == [store.name(s) for s in reversed(steps)]  # fit waited for the last
    for step in steps:
        # The steps that ran during the write did not change what it wrote.
        arrays = store.load(store.name(step)).arrays
        model_arrays = arrays[: len(record.weights[step])]
        assert all(np.array_equal(a, b) for a, b in zip(model_arrays, record.weights[step]))


def test_background_write_error_raises_at_next_step_and_keeps_last_backup(small_tmpfs):
    backup_dir = small_tmpfs / "b"
    steps = workers.step_counter()
    with pytest.raises(tfscale.callbacks.BackupWriteError) as raised:
        _fit(backup_dir, [_fill_disk_after(7, small_tmpfs, backup_dir), steps], async_save=True)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    failed = re.search(rf"step (\d+) to '{backup_dir}/\.tmp-ckpt-0+(\d+)-.*No space left on device", message)
    kept = re.search(rf"last backup is kept \({backup_dir}/ckpt-0+(\d+)\)", message)
    assert failed and kept, message
    failed_step, kept_step = int(failed[1]), int(kept[1])
    # The first backup after the disk filled (after step 7) failed; the one before is kept.
    assert int(failed[2]) == failed_step and kept_step <= 7 < failed_step <= 7 + 5
    # Raised on the training thread at a step after the failed write (the counter runs after
    # the backup callback: it did not count the step that raised), before the next backup.
    assert failed_step <= steps.steps < failed_step + 5
    assert workers.listing(backup_dir) == [f"ckpt-{kept_step:012d}"]
    os.remove(small_tmpfs / "filler")
    resumed = _fit(backup_dir, [], delete_checkpoint=False)
    assert resumed.restored_from["global_step"] == kept_step


def test_fit_that_raises_mid_write_publishes_it_and_next_fit_resumes_from_it(tmp_path, reference):
    backup_dir = str(tmp_path / "b")
    writes = []

    class RaiseMidWrite(workers.slow_backup_class(0.1, writes, step_seconds=0.03)):
        def on_train_batch_end(self, batch, logs=None):
            super().on_train_batch_end(batch, logs)
            if self._global_step >= 8 and self._writer.busy():
                raise tfscale.callbacks.InjectedFault(
                    f"raised while the backup of step {writes[-1][0]} is written"
                )

    with pytest.raises(tfscale.callbacks.InjectedFault) as raised:
        workers.train(backup_dir, callback_class=RaiseMidWrite, async_save=True)
    in_flight = writes[-1][0]
    assert str(in_flight) in str(raised.value) and len(writes) >= 2
    # A new callback (a fresh `fit`) waits for that write instead of resuming from the one before.
    resumed = workers.train(backup_dir, async_save=True)
    assert resumed["restored"]["global_step"] == in_flight
    assert resumed["steps_run"] == TOTAL_STEPS - in_flight
    assert max_diff(resumed, reference()) <= 1e-6


@pytest.mark.slow  # 13 s; fast tier: test_backup_and_restore's SIGTERM tests
def test_sigterm_backup_is_written_before_exit_even_with_a_write_in_flight(tmp_path, reference):
    import signal

    backup_dir = str(tmp_path / "b")
    writes = []
    slow = workers.slow_backup_class(0.1, writes, step_seconds=0.03)
    with pytest.raises(SystemExit) as exited:
        # SIGTERM at the first step end from step 8 on with a write in flight; the backup of
        # the next step is written synchronously, after the one in flight is published.
        workers.train(
            backup_dir, callback_class=workers.kill_mid_write_class(slow, 8, signal.SIGTERM), async_save=True
        )
    assert exited.value.code == tfscale.callbacks.RESTART_EXIT_CODE
    (in_flight, thread), (last, last_thread) = writes[-2:]
    assert thread == "tfscale-backup-writer" and last_thread == "MainThread" and in_flight < last
    assert workers.listing(backup_dir) == [f"ckpt-{last:012d}"]  # published, the older one pruned
    resumed = workers.train(backup_dir, async_save=True)
    assert resumed["steps_run"] == TOTAL_STEPS - last
    assert max_diff(resumed, reference()) <= 1e-6


def test_backup_of_the_synchronous_writer_resumes_exactly_with_async(tmp_path, reference):
    # One on-disk format for both: a backup the synchronous code path
    # wrote restores under async_save=True, and the reverse.
    backup_dir = str(tmp_path / "b")
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(backup_dir, fail={"step": 22, "mode": "raise"}, async_save=False)
    resumed = workers.train(backup_dir, async_save=True)
    assert resumed["restored"]["global_step"] == 20
    assert max_diff(resumed, reference()) <= 1e-6


@pytest.mark.parametrize(
    ("dataset", "steps_per_execution"),
    [("array", 2), pytest.param("tfdata_reshuffle", 1, marks=pytest.mark.slow)],
)
def test_early_snapshots_resume_mid_epoch_exactly(tmp_path, reference, dataset, steps_per_execution):
    # Early snapshots land mid-epoch, at steps that are not multiples of save_freq, under
    # steps_per_execution and with an input that reshuffles each epoch: the resume is exact.
    backup_dir = str(tmp_path / "b")
    options = {"dataset": dataset, "steps_per_execution": steps_per_execution, "async_save": True}
    slow = workers.slow_backup_class(0.03, step_seconds=0.01)
    with pytest.raises(tfscale.callbacks.InjectedFault):
        workers.train(backup_dir, fail={"step": 34, "mode": "raise"}, callback_class=slow, **options)
    resumed = workers.train(backup_dir, **options)
    restored = resumed["restored"]["global_step"]
    assert 34 - 5 <= restored <= 34 and restored % steps_per_execution == 0
    assert resumed["steps_run"] == TOTAL_STEPS - restored
    assert max_diff(resumed, reference(dataset, steps_per_execution)) <= 1e-6
