"""`BackupAndRestore(async_save=True)`: the write leaves the training thread, the guarantees stay.

Writes are slowed down on purpose (a real sleep in the real store's write) so that the
steps after a backup run while it is in flight.
"""

import os
import re
import time

import _backup_workers as workers
import numpy as np
import pytest
from test_backup_and_restore import TOTAL_STEPS, _fill_disk_after, _fit, max_diff, reference, small_tmpfs

import tfscale.callbacks
from tfscale.callbacks import _backup_store

__all__ = ["reference", "small_tmpfs"]  # fixtures used here


def _weights_at_each_step():
    import keras

    class Record(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.weights = {}

        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            self.weights[step] = [v.value.numpy().copy() for v in self.model.variables]

    return Record()


def test_writes_off_the_training_thread_from_a_copy_and_skips_none(tmp_path):
    import tfscale.strategies

    writes = []
    model = workers.build_model(tfscale.strategies.get("one_device"))
    backup = workers.slow_backup_class(0.05, writes)(
        str(tmp_path / "b"), save_freq=5, max_to_keep=100, delete_checkpoint=False, async_save=True
    )
    record = _weights_at_each_step()
    start = time.perf_counter()
    model.fit(**workers.make_data("array", 8), epochs=3, callbacks=[backup, record], verbose=0)
    assert time.perf_counter() - start > 9 * 0.05  # fit returned only after the last write
    steps = list(range(5, TOTAL_STEPS + 1, 5))
    assert [s for s, _ in writes] == steps  # a backup due during a write waited; none skipped
    assert all(name == "tfscale-backup-writer" for _, name in writes)
    assert backup._writer.waits > 0  # 5 steps take less than a 50 ms write
    store = _backup_store.BackupStore(backup.backup_dir, 100)
    assert store.published() == [store.name(s) for s in reversed(steps)]
    for step in steps:
        # The steps that ran during the write did not change what it wrote.
        arrays = store.load(store.name(step)).arrays
        model_arrays = arrays[: len(record.weights[step])]
        assert all(np.array_equal(a, b) for a, b in zip(model_arrays, record.weights[step]))


def test_background_write_error_raises_at_next_step_and_keeps_last_backup(small_tmpfs):
    backup_dir = small_tmpfs / "b"
    steps = workers.step_counter()
    with pytest.raises(tfscale.callbacks.BackupWriteError) as raised:
        _fit(backup_dir, [_fill_disk_after(7, small_tmpfs), steps], async_save=True)
    message = str(raised.value)
    assert len(message.splitlines()) == 1
    assert re.search(rf"step 10 to '{backup_dir}/\.tmp-ckpt-0+10-.*No space left on device", message)
    assert "last backup is kept" in message and "ckpt-000000000005" in message
    # Raised on the training thread at a step after the failed write (the counter runs after
    # the backup callback: it did not count the step that raised), before the next backup.
    assert 10 <= steps.steps < 15
    assert os.listdir(backup_dir) == ["ckpt-000000000005"]
    os.remove(small_tmpfs / "filler")
    resumed = _fit(backup_dir, [], delete_checkpoint=False)
    assert resumed.restored_from["global_step"] == 5


def test_fit_that_raises_mid_write_publishes_it_and_next_fit_resumes_from_it(tmp_path, reference):
    backup_dir = str(tmp_path / "b")
    slow = workers.slow_backup_class(0.5)
    with pytest.raises(tfscale.callbacks.InjectedFault):
        # Raises at step 11, while the backup of step 10 is still being written.
        workers.train(backup_dir, fail={"step": 11, "mode": "raise"}, callback_class=slow, async_save=True)
    # A new callback (a fresh `fit`) waits for that write instead of resuming from step 5.
    resumed = workers.train(backup_dir, async_save=True)
    assert resumed["restored"]["global_step"] == 10
    assert resumed["steps_run"] == TOTAL_STEPS - 10
    assert max_diff(resumed, reference()) <= 1e-6


def test_sigterm_backup_is_written_before_exit_even_with_a_write_in_flight(tmp_path, reference):
    backup_dir = str(tmp_path / "b")
    with pytest.raises(SystemExit) as exited:
        # SIGTERM noticed after step 10 (backup of 10 in flight), saved synchronously after 11.
        workers.train(
            backup_dir,
            fail={"step": 9, "mode": "sigterm"},
            callback_class=workers.slow_backup_class(0.3),
            async_save=True,
        )
    assert exited.value.code == tfscale.callbacks.RESTART_EXIT_CODE
    assert sorted(os.listdir(backup_dir)) == ["ckpt-000000000011"]  # published, and 10 pruned
    resumed = workers.train(backup_dir, async_save=True)
    assert resumed["steps_run"] == TOTAL_STEPS - 11
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
