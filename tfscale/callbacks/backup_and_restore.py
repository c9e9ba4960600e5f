"""`BackupAndRestore`: Keras's callback, made atomic, multi-worker safe and exact mid-epoch."""

import logging
import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfscale.callbacks import _backup_cluster, _backup_keras
from tfscale.callbacks._backup_preemption import RESTART_EXIT_CODE, PreemptionWatch
from tfscale.callbacks._backup_store import BackupStore, UnusableBackupError
from tfscale.errors import Error

__all__ = [
    "RESTART_EXIT_CODE",
    "BackupAndRestore",
    "BackupError",
    "BackupMismatchError",
    "UnusableBackupError",
]

_log = logging.getLogger("tfscale")


class BackupError(Error):
    """Bad arguments for `BackupAndRestore`, or a backup this training cannot use."""


class BackupMismatchError(BackupError):
    """The backup was made by a different model or optimizer (nothing was loaded)."""


def _check_args(backup_dir, save_freq, double_checkpoint, delete_checkpoint, *, max_to_keep, preemption):
    def bad(name, value, expected):
        return BackupError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected}."
        )

    if not isinstance(backup_dir, (str, os.PathLike)) or not os.fspath(backup_dir):
        raise bad("backup_dir", backup_dir, "a non-empty directory path")
    if not (save_freq == "epoch" or save_freq is False or (type(save_freq) is int and save_freq > 0)):
        raise bad("save_freq", save_freq, "either 'epoch', a positive integer, or False")
    for name, value in (
        ("double_checkpoint", double_checkpoint),
        ("delete_checkpoint", delete_checkpoint),
        ("save_before_preemption", preemption),
    ):
        if not isinstance(value, bool):
            raise bad(name, value, "True or False")
    least = 2 if double_checkpoint else 1
    if max_to_keep is not None and (type(max_to_keep) is not int or max_to_keep < least):
        raise bad("max_to_keep", max_to_keep, f"None or an integer >= {least}")


def _signature(variables):
    return [[v.path, list(v.shape), str(v.dtype)] for v in variables]


class BackupAndRestore(keras.callbacks.Callback):
    """Callback to back up and restore the training state, atomically and exactly.

    A drop-in for `keras.callbacks.BackupAndRestore` (same arguments, same meaning)
    that also:

    - writes each backup (weights, optimizer state, dropout RNG state, epoch, step in
      the epoch, input position) into a temporary directory, fsyncs it and publishes it
      with one rename; a manifest with a sha256 lets restore reject a torn backup and
      fall back to the previous one (keep several with `max_to_keep`);
    - resumes mid-epoch exactly: the resumed `fit` runs only the steps not yet done,
      on the batches an uninterrupted run would have used (see README for which inputs);
    - under `MultiWorkerMirroredStrategy`, only the chief (or worker 0) writes, every
      worker restores the same backup (checked with an all-reduce);
    - on SIGTERM, saves at the next step boundary (the same step on every worker) and
      exits with `RESTART_EXIT_CODE` (75), so a supervisor restarts the job;
    - refuses, with `BackupMismatchError`, a backup made by a different model.

    Example:

    ```python
    callback = tfscale.callbacks.BackupAndRestore("/tmp/backup", save_freq=100)
    model.fit(x, y, epochs=10, callbacks=[callback])  # rerun the same line after a crash
    ```

    Args:
        backup_dir: directory for the backups, on storage every worker can read. Not
            to be shared with another run or callback.
        save_freq: `"epoch"` (back up at each epoch end), an integer N (back up every N
            batches, counted over the whole run), or `False` (only on preemption).
        double_checkpoint: keep the previous backup too (at least 2), to fall back on
            if the newest one is unreadable.
        delete_checkpoint: remove `backup_dir` when `fit` completes.
        max_to_keep: how many backups to keep (default 2 with `double_checkpoint`,
            else 1). A new backup is always published before old ones are removed.
        save_before_preemption: on SIGTERM, back up at the next step and exit with
            `RESTART_EXIT_CODE` (TensorFlow's `PreemptionCheckpointHandler`).

    Raises:
        BackupError: an argument is invalid.
    """

    def __init__(
        self,
        backup_dir,
        save_freq="epoch",
        double_checkpoint=False,
        delete_checkpoint=True,
        *,
        max_to_keep=None,
        save_before_preemption=True,
    ):
        super().__init__()
        _check_args(
            backup_dir,
            save_freq,
            double_checkpoint,
            delete_checkpoint,
            max_to_keep=max_to_keep,
            preemption=save_before_preemption,
        )
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep or (2 if double_checkpoint else 1)
        self.save_before_preemption = save_before_preemption
        self._store = BackupStore(self.backup_dir, self.max_to_keep)
        self.restored_from = None  # meta of the backup the last `fit` resumed from

    # --- the training state ---------------------------------------------------------

    def _variables(self):
        optimizer = self.model.optimizer
        return list(self.model.variables), list(optimizer.variables) if optimizer is not None else []

    def _ensure_built(self):
        if not self.model.built:
            raise BackupError(
                f"To use the BackupAndRestore callback, the model must be built before `fit()`. "
                f"Model {self.model.name} is unbuilt: build it by calling it on a batch of data."
            )
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built:
            with self.model.distribute_strategy.scope():
                optimizer.build(self.model.trainable_variables)

    def _meta(self, at_epoch_end):
        model_vars, opt_vars = self._variables()
        made, live, taken = (
            self._tracker.position(at_epoch_end=at_epoch_end) if self._tracker else (0, False, 0)
        )
        return {
            "epoch": self._epoch,
            "step": self._step,
            "global_step": self._global_step,
            "input": {"iterators_made": made, "live": live, "batches_taken": taken},
            "model": _signature(model_vars),
            "optimizer": type(self.model.optimizer).__name__ if self.model.optimizer else None,
            "optimizer_variables": _signature(opt_vars),
            "saved_by": self._role.label,
            "time": time.time(),
            "keras": keras.__version__,
        }

    def _save(self, at_epoch_end=False, reason="scheduled"):
        if self._last_saved == self._global_step:
            return
        model_vars, opt_vars = self._variables()
        # Every worker reads the values: reading a sync-on-read variable is a collective.
        arrays = [np.asarray(v.value.numpy()) for v in model_vars + opt_vars]
        meta = self._meta(at_epoch_end)
        self._last_saved = self._global_step
        if not self._role.writer:
            return
        path = self._store.write(self._global_step, meta, arrays)
        self._store.prune(self._global_step)
        _log.info(
            "tfscale: %s backup %s (epoch %d, step %d, global step %d)",
            reason,
            path,
            self._epoch,
            self._step,
            self._global_step,
        )

    def _check_compatible(self, backup):
        meta = backup.meta
        model_vars, opt_vars = self._variables()
        optimizer = type(self.model.optimizer).__name__ if self.model.optimizer else None
        if meta["optimizer"] != optimizer:
            raise self._mismatch(backup, f"optimizer {meta['optimizer']} in the backup, {optimizer} here")
        for kind, saved, current in (
            ("variable", meta["model"], model_vars),
            ("optimizer variable", meta["optimizer_variables"], opt_vars),
        ):
            if len(saved) != len(current):
                raise self._mismatch(backup, f"{len(saved)} {kind}s in the backup, {len(current)} here")
            for i, ((name, shape, dtype), v) in enumerate(zip(saved, current)):
                if shape != list(v.shape) or dtype != str(v.dtype):
                    raise self._mismatch(
                        backup,
                        f"{kind} {i} is {name!r} {tuple(shape)} {dtype} in the backup, "
                        f"{v.path!r} {tuple(v.shape)} {v.dtype} here",
                    )

    def _mismatch(self, backup, detail):
        return BackupMismatchError(
            f"Backup {backup.path} was made by a different model ({detail}); nothing was loaded. "
            "Expected the same model and optimizer, or a fresh `backup_dir`."
        )

    def _restore(self, backup):
        self._check_compatible(backup)
        model_vars, opt_vars = self._variables()
        for v, value in zip(model_vars + opt_vars, backup.arrays):
            v.assign(value)
        meta = backup.meta
        self._epoch, self._step, self._global_step = meta["epoch"], meta["step"], meta["global_step"]
        self._last_saved = self._global_step
        _backup_keras.set_initial_epoch(self.model, self._epoch)
        if self._tracker is not None:
            position = meta["input"]
            self._tracker.resume(step=self._step, **position)
        elif self._step:
            raise BackupError(
                f"Backup {backup.path} is from the middle of epoch {self._epoch} (step {self._step}), "
                "but this `fit` gives no access to its input (not the TensorFlow backend's `fit`). "
                "Expected `save_freq='epoch'` backups here."
            )
        self.restored_from = meta
        _log.info(
            "tfscale: resumed from %s (epoch %d, step %d; global step %d) in %s",
            os.path.basename(backup.path),
            self._epoch,
            self._step,
            self._global_step,
            os.path.dirname(backup.path),
        )

    # --- Keras callback hooks -------------------------------------------------------

    def on_train_begin(self, logs=None):
        strategy = self.model.distribute_strategy
        self._role = _backup_cluster.role(strategy)
        self._multi_worker = self._role.num_workers > 1 and isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        )
        self._epoch, self._step, self._global_step, self._last_saved = 0, 0, 0, None
        self.restored_from = None
        self._ensure_built()
        epoch_iterator = _backup_keras.find_epoch_iterator(self.model)
        self._tracker = _backup_keras.InputTracker(epoch_iterator) if epoch_iterator is not None else None
        backup, _ = self._store.load_newest()
        if self._multi_worker and not _backup_cluster.all_agree(
            strategy, backup.meta["global_step"] if backup else -1
        ):
            raise BackupError(
                f"Workers found different backups in `backup_dir={self.backup_dir!r}` ({self._role.label} "
                f"found {backup.path if backup else 'none'}). Expected a directory every worker can read."
            )
        if backup is not None:
            self._restore(backup)
        self._preemption = None
        if self.save_before_preemption:
            self._preemption = PreemptionWatch(
                strategy,
                multi_worker=self._multi_worker,
                save_fn=lambda: self._save(reason="preemption"),
                unused_dir=os.path.join(self.backup_dir, ".tf-preemption-unused"),
            )

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._epoch, self._step = epoch, 0

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch

    def on_train_batch_end(self, batch, logs=None):
        done = batch - self._begin + 1
        before = self._global_step
        self._step = batch + 1
        self._global_step += done
        freq = self.save_freq
        if type(freq) is int and self._global_step // freq > before // freq:
            self._save()
        if self._preemption is not None:
            self._preemption.step_done()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._step = epoch + 1, 0
        if self.save_freq == "epoch":
            self._save(at_epoch_end=True)

    def on_train_end(self, logs=None):
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        if self._tracker is not None:
            self._tracker.close()
        _backup_keras.set_initial_epoch(self.model, None)
        if self.delete_checkpoint and self._role.writer:
            self._store.remove_all()
