"""`BackupAndRestore` for `--elastic_batch=per_replica`: resume a backup made with another global batch.

`BackupAndRestore` stores the input position in batches (global steps). When the
global batch is kept across a size change (`--elastic_batch=global`) that is all
it needs. With `per_replica` the global batch changes with the size, so a
mid-epoch position must be converted: the backup also records its global batch,
and a run with another one resumes the same epoch (the same shuffled order) at
`examples_done // new_batch` batches, i.e. at the last whole new batch before the
position. Exact when the position is a multiple of the new batch; otherwise the
fewer than `new_batch` examples since that batch boundary are trained on again.
Keras keeps the learning rate among the optimizer's variables, so the restore brings
back the rate of the backup's size; it is scaled by new / old global batch, the linear
scaling rule `--elastic_batch=per_replica` follows (a warmup or schedule callback that
sets the rate itself still does).
"""

import dataclasses
import logging

import keras

from tfscale.callbacks.backup_and_restore import BackupAndRestore, BackupError

__all__ = ["ElasticBackupAndRestore"]

_log = logging.getLogger("tfscale")


class ElasticBackupAndRestore(BackupAndRestore):
    """`BackupAndRestore` whose backups can be resumed under another global batch.

    Args:
        backup_dir: as for `BackupAndRestore`.
        global_batch_size: the global batch (examples per step) of this run.
        **kwargs: the other `BackupAndRestore` arguments.
    """

    def __init__(self, backup_dir, *, global_batch_size, **kwargs):
        super().__init__(backup_dir, **kwargs)
        self.global_batch_size = global_batch_size

    _uniform_steps = False  # a resize changes the steps of an epoch

    def _meta(self, at_epoch_end):
        return {**super()._meta(at_epoch_end), "global_batch_size": self.global_batch_size}

    def _restore(self, backup):
        old = backup.meta.get("global_batch_size", self.global_batch_size)
        position = backup.meta["input"]
        if old != self.global_batch_size and position["live"] and position["batches_taken"]:
            if self._tracker is not None and self._tracker.steps_per_execution != 1:
                raise BackupError(
                    f"Backup {backup.path} is from the middle of an epoch with global batch {old}; "
                    f"resuming it with global batch {self.global_batch_size} needs steps_per_execution=1."
                )
            examples = position["batches_taken"] * old
            taken = examples // self.global_batch_size
            _log.info(
                "tfscale: elastic resume: example %d of epoch %d (%d steps of %d) is step %d of %d here; "
                "%d examples train again",
                examples,
                backup.meta["epoch"],
                position["batches_taken"],
                old,
                taken,
                self.global_batch_size,
                examples - taken * self.global_batch_size,
            )
            meta = {**backup.meta, "step": taken, "input": {**position, "batches_taken": taken}}
            backup = dataclasses.replace(backup, meta=meta)
        super()._restore(backup)
        optimizer = self.model.optimizer
        if old != self.global_batch_size and optimizer is not None:
            # A distributed variable under tf.distribute: float() of it is a TypeError.
            restored = float(keras.ops.convert_to_numpy(optimizer.learning_rate))
            try:
                optimizer.learning_rate = restored * self.global_batch_size / old
            except TypeError:  # a LearningRateSchedule: it computes the rate itself
                return
            _log.info(
                "tfscale: elastic resume: learning rate %g -> %g (x %d/%d, global batch)",
                restored,
                restored * self.global_batch_size / old,
                self.global_batch_size,
                old,
            )
