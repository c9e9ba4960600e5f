"""`BackupAndRestore`: Keras's callback, made atomic, multi-worker safe and exact mid-epoch."""

import functools
import logging
import math
import os
import re
import time

import keras
import numpy as np
import tensorflow as tf

from tfscale import _task_protocol
from tfscale._save_policy import SavePolicy
from tfscale.callbacks import _backup_cluster, _backup_metrics, _backup_placed
from tfscale.callbacks._backup_lock import DirectoryLock, LockHeldError
from tfscale.callbacks._backup_preemption import RESTART_EXIT_CODE, PreemptionWatch
from tfscale.callbacks._backup_store import BackupStore, NpzShard, UnusableBackupError
from tfscale.callbacks._backup_writer import BackgroundWriter, wait_for_directory
from tfscale.cluster import ClusterSpec
from tfscale.compat import keras_fit_position, keras_optimizer_zero, keras_symbolic_build, tf_function_tracing
from tfscale.errors import Error

__all__ = [
    "RESTART_EXIT_CODE",
    "BackupAndRestore",
    "BackupError",
    "BackupInUseError",
    "BackupMismatchError",
    "BackupWriteError",
    "UnusableBackupError",
]

_log = logging.getLogger("tfscale")


class BackupError(Error):
    """Bad arguments for `BackupAndRestore`, or a backup this training cannot use."""


class BackupMismatchError(BackupError):
    """The backup was made by a different model or optimizer (nothing was loaded)."""


class BackupInUseError(BackupError):
    """`backup_dir` belongs to another job: held by a live one, or holding another job's backups."""


JOB_ID_VAR = _task_protocol.JOB_ID_VAR  # set by tfscale-launch for its tasks (launch/jobs.py)


class BackupWriteError(BackupError, OSError):
    """`backup_dir` cannot take a backup (not a directory, read-only, full); the last one is kept."""


def _check_args(
    backup_dir,
    save_freq,
    double_checkpoint,
    delete_checkpoint,
    *,
    max_to_keep,
    preemption,
    async_save,
    job_id=None,
):
    def bad(name, value, expected):
        return BackupError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected {expected}."
        )

    path = os.fspath(backup_dir) if isinstance(backup_dir, (str, os.PathLike)) else None
    if not isinstance(path, str) or not path or "\0" in path:
        raise bad("backup_dir", backup_dir, "a non-empty directory path (str or os.PathLike, no NUL)")
    if not (save_freq == "epoch" or save_freq is False or (type(save_freq) is int and save_freq > 0)):
        raise bad("save_freq", save_freq, "either 'epoch', a positive integer, or False")
    for name, value in (
        ("double_checkpoint", double_checkpoint),
        ("delete_checkpoint", delete_checkpoint),
        ("save_before_preemption", preemption),
        ("async_save", async_save),
    ):
        if not isinstance(value, bool):
            raise bad(name, value, "True or False")
    if job_id is not None and not (
        isinstance(job_id, str) and 0 < len(job_id) <= 200 and job_id.isprintable()
    ):
        raise bad("job_id", job_id, "None or a printable string of 1 to 200 characters")
    least = 2 if double_checkpoint else 1
    if max_to_keep is not None and (type(max_to_keep) is not int or max_to_keep < least):
        raise bad("max_to_keep", max_to_keep, f"None or an integer >= {least}")


def _quiet_tracing(function):
    """Stops TensorFlow's "triggered tf.function retracing" warning for `function`.

    Each `fit` traces its own snapshot function once (it captures that model's
    variables); TensorFlow counts traces by source line, so a process that runs many
    short `fit`s would warn although no function is ever retraced.
    """
    return tf_function_tracing.quiet_retracing(function)


def _group_by_device(variables):
    """Variable indices grouped by where they live: `(this process's devices, other tasks)`.

    Each is a list of `(device, [indices])` in first-seen order. A replicated variable
    (a strategy's mirrored variable) counts once, on its primary device.
    """
    here = tf.zeros(()).device  # this process's task (a job:localhost or cluster name)
    local, other = {}, {}
    for i, v in enumerate(variables):
        device = v.value.device or here
        if _backup_placed.is_other_task(device, here):
            other.setdefault(_backup_placed.task_cpu(device), []).append(i)
        else:
            local.setdefault(device, []).append(i)
    return list(local.items()), list(other.items())


def _structural_name(path):
    # "adam_1/sequential_3_dense_7_kernel" -> "adam/sequential_dense_kernel": Keras numbers
    # unnamed layers by how many were built before in the process, which a restart changes.
    return re.sub(r"_[0-9]+(?=_|/|$)", "", path)


def _is_count(value):
    return type(value) is int and value >= 0


def _is_signature(entries):
    return isinstance(entries, list) and all(
        isinstance(e, list)
        and len(e) == 3
        and isinstance(e[0], str)
        and isinstance(e[1], list)
        and all(_is_count(d) for d in e[1])
        and isinstance(e[2], str)
        for e in entries
    )


def _check_consistent(backup):
    """Raises `UnusableBackupError` unless the manifest's metadata is whole and describes
    exactly the arrays stored beside it (a manifest and state that do not belong together
    are as torn as a truncated file)."""
    meta = backup.meta

    def torn(what):
        return UnusableBackupError(f"its manifest {what}")

    if not isinstance(meta, dict):
        raise torn("holds no metadata")
    for key in ("epoch", "step", "global_step"):
        if not _is_count(meta.get(key)):
            raise torn(f"has no valid `{key}`")
    position = meta.get("input")
    if not (
        isinstance(position, dict)
        and all(_is_count(position.get(k)) for k in ("iterators_made", "batches_taken"))
        and isinstance(position.get("live"), bool)
    ):
        raise torn("has no valid input position")
    if not (meta.get("optimizer") is None or isinstance(meta.get("optimizer"), str)):
        raise torn("has no valid optimizer name")
    signature = []
    # `metric_variables`: since format 4 (a backup without it restores no metric state).
    metrics = ("metric_variables",) if "metric_variables" in meta else ()
    for key in ("model", "optimizer_variables", *metrics):
        if not _is_signature(meta.get(key)):
            raise torn(f"has no valid `{key}` list")
        signature += meta[key]
    if len(signature) != len(backup.arrays):
        raise torn(f"lists {len(signature)} variables, its shards hold {len(backup.arrays)}")
    for i, ((name, shape, dtype), array) in enumerate(zip(signature, backup.arrays)):
        # `.dtype.name` reads the same for numpy arrays and tensors (placed shards).
        if list(array.shape) != shape or array.dtype.name != dtype:
            raise torn(
                f"says variable {i} ({name!r:.80}) is {tuple(shape)} {dtype:.20}, "
                f"its shard holds {tuple(array.shape)} {array.dtype.name}"
            )
    name = os.path.basename(backup.path)
    if re.fullmatch(r"ckpt-[0-9]{12,}", name) and int(name[5:]) != meta["global_step"]:
        raise torn(f"says global step {meta['global_step']}, its name {name}")
    # (`step > global_step` is impossible only when every epoch had this fit's steps: an
    # elastic resize converts the step to the new batch size; `_check_in_range` checks it.)
    if not (meta.get("job_id") is None or isinstance(meta.get("job_id"), str)):
        raise torn("has an invalid job_id")


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
    - refuses, with `BackupMismatchError`, a backup made by a different model;
    - with `async_save=True`, costs the training step only a copy of the state to
      host memory: the write happens on a background thread (see `async_save`).

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
        delete_checkpoint: when `fit` completes, remove the backups (only the entries
            tfscale wrote; `backup_dir` itself only if that leaves it empty).
        max_to_keep: how many backups to keep (default 2 with `double_checkpoint`,
            else 1). A new backup is always published before old ones are removed.
        save_before_preemption: on SIGTERM, back up at the next step and exit with
            `RESTART_EXIT_CODE` (TensorFlow's `PreemptionCheckpointHandler`).
        job_id: who owns the backups: recorded in each one, and a backup with another
            `job_id` is refused (one line) instead of resumed. Default: the
            `TFSCALE_JOB_ID` environment variable (`tfscale-launch` sets it for its
            tasks), else None. A live job also holds `backup_dir` for the life of
            `fit`: a second job on it fails before its first step (`BackupInUseError`).
        async_save: write backups on a background thread. The training thread copies
            the state to host memory (one extra copy at most) and goes on. With an
            integer `save_freq`, a kill still loses at most `save_freq` steps, as with
            synchronous saves: each snapshot is taken early, about twice the steps a
            write has been taking (at most `save_freq // 2`) before the newest published
            backup would be `save_freq` steps old, so backups come somewhat more often
            than every `save_freq` steps and at steps that are not its multiples; if a
            write is still in flight when the next step would leave more than
            `save_freq` steps unprotected, the step waits for it (at most one write is
            ever in flight; none is skipped). With `"epoch"`, a kill during the write
            loses that epoch too. A failed background write raises `BackupWriteError`
            at the next step. The SIGTERM backup is written synchronously, and `fit`
            ends only after the last write is published (after a `fit` that raised, the
            write in flight is still published: the next `fit` waits for it). Off by
            default, like Keras, TensorFlow and Orbax: backups land exactly every
            `save_freq` steps and no extra copy of the state is held.

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
        async_save=False,
        job_id=None,
    ):
        super().__init__()
        # A `fit` that raises parks its live input iterators instead of leaving them to a
        # garbage collection or tearing them down while they prefetch (see the compat module).
        keras_symbolic_build.park_interrupted_inputs()
        if job_id is None:
            job_id = os.environ.get(JOB_ID_VAR) or None
        _check_args(
            backup_dir,
            save_freq,
            double_checkpoint,
            delete_checkpoint,
            max_to_keep=max_to_keep,
            preemption=save_before_preemption,
            async_save=async_save,
            job_id=job_id,
        )
        self.job_id = job_id
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self._policy = SavePolicy(save_freq, async_save)  # remade at each fit's start
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.max_to_keep = max_to_keep or (2 if double_checkpoint else 1)
        self.save_before_preemption = save_before_preemption
        self.async_save = async_save
        self._store = BackupStore(
            self.backup_dir, self.max_to_keep, readers={_backup_placed.KIND: _backup_placed.read}
        )
        self._writer = BackgroundWriter(self.backup_dir)
        self._read_key, self._read_fn = None, None
        self.restored_from = None  # meta of the backup the last `fit` resumed from
        self._pending_metrics = None  # a mid-epoch backup's metric state, until its epoch begins

    # --- the training state ---------------------------------------------------------

    def _variables(self):
        optimizer = self.model.optimizer
        if optimizer is None:
            return list(self.model.variables), []
        # Without a ZeRO job's parameter shards (rewritten from the parameters at every step).
        return list(self.model.variables), keras_optimizer_zero.saved_variables(optimizer)

    def _full_shape(self, variable):
        """A ZeRO slot's whole variable's shape (what a backup holds); None for any other variable."""
        optimizer = self.model.optimizer
        return None if optimizer is None else keras_optimizer_zero.full_shape(optimizer, variable)

    def _shape(self, variable):
        full = self._full_shape(variable)
        return list(variable.shape if full is None else full)

    def _signature(self, variables):
        return [[v.path, self._shape(v), str(v.dtype)] for v in variables]

    def _saved_variables(self):
        """Everything a backup holds, in order: the model's, the optimizer's, the metrics'."""
        model_vars, opt_vars = self._variables()
        return model_vars + opt_vars + _backup_metrics.metric_variables(self.model)

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
            "model": self._signature(model_vars),
            "optimizer": type(self.model.optimizer).__name__ if self.model.optimizer else None,
            "optimizer_variables": self._signature(opt_vars),
            # The epoch's metric state so far: a mid-epoch resume puts it back (`_backup_metrics`).
            "metric_variables": self._signature(_backup_metrics.metric_variables(self.model)),
            "saved_by": self._task.task_label,
            "job_id": self.job_id,
            "time": time.time(),
            "keras": keras.__version__,
        }

    def _snapshot(self):
        """The state as shards: one per device of this process, one per other task.

        The variables of this process are read in one tf.function (one call instead of
        one eager read per variable: under `MultiWorkerMirroredStrategy` each eager read
        of a sync-on-read variable is a collective that warns about eager overhead) and
        copied to host memory, grouped by device. The variables of another task are
        serialized on that task and stay there (`_backup_placed`): they never pass
        through this process. Both are copies, so the steps that run while a background
        write is in flight cannot change what it writes.
        """
        read_local, placed = self._snapshot_function()
        # `Tensor.numpy()` copies (documented); asarray only turns scalars into 0-d arrays.
        read = iter([np.asarray(t.numpy()) for t in read_local()])
        # A ZeRO slot is read as its replicas' shards, each from its own device, and put
        # together here on the host (`_snapshot_function`).
        values = [
            next(read)
            if shape is None
            else keras_optimizer_zero.join_shards([next(read) for _ in range(n)], shape)
            for shape, n in self._parts
        ]
        shards, start = [], 0
        for device, indices in self._layout[0]:
            shards.append(NpzShard(device, indices, values[start : start + len(indices)]))
            start += len(indices)
        for device, indices, serialize, dtypes in placed:
            shards.append(_backup_placed.PlacedShard(device, indices, serialize(), dtypes))
        return shards

    def _snapshot_function(self):
        """`(read_local, [(task, indices, serialize, dtypes)])`, traced once per set of variables."""
        variables = self._saved_variables()
        # The key changes when Keras builds the compiled metrics at the first step (a
        # model compiled outside any strategy scope): then this traces once more.
        key = tuple(id(v) for v in variables)
        if key != self._read_key:
            local, other = _group_by_device(variables)
            values, self._parts = [], []
            for i in (i for _, indices in local for i in indices):
                shape = self._full_shape(variables[i])
                parts = (
                    keras_optimizer_zero.components(variables[i])
                    if shape is not None
                    else [variables[i].value]
                )
                values += parts
                self._parts.append((shape, len(parts)))
            self._read_fn = _quiet_tracing(tf.function(lambda: [tf.identity(v) for v in values]))
            # Traced and run once now, not in the first backup's step: the first call of a
            # traced function also instantiates it (~60 ms for a 280k-parameter MLP).
            self._read_fn()
            self._layout = (
                local,
                [
                    (
                        device,
                        indices,
                        _backup_placed.snapshot_function(device, [variables[i] for i in indices]),
                        [str(variables[i].dtype) for i in indices],
                    )
                    for device, indices in other
                ],
            )
            self._read_key = key
        return self._read_fn, self._layout[1]

    def _raise_write_error(self):
        error = self._writer.take_error()
        if error is not None:
            raise error

    def _save(self, at_epoch_end=False, reason="scheduled", sync=False):
        if sync:
            # The process exits right after a synchronous (preemption) save: the write in
            # flight is published first, and one that failed is retried, not lost.
            self._writer.wait()
            error, job = self._writer.take_failure()
            if error is not None:
                _log.warning("tfscale: a background backup failed (%s); saving synchronously", error)
                if self._last_saved == self._global_step:
                    job()  # its snapshot is this step's: no worker reads the variables again
                    return
        if self._last_saved == self._global_step:
            return
        # At most one write in flight, and so at most one extra copy of the state: the
        # next backup waits for the previous write before taking its snapshot.
        self._writer.wait()
        self._raise_write_error()
        # Every worker reads the values: reading a sync-on-read variable is a collective.
        shards = self._snapshot()
        meta = self._meta(at_epoch_end)
        self._last_saved = self._global_step
        if not self._task.is_writer:
            return
        job = functools.partial(
            self._write, self._global_step, meta, shards, reason, (self._epoch, self._step)
        )
        if self.async_save and not sync:
            self._writer.submit(job)
        else:
            job()

    def _write(self, global_step, meta, shards, reason, position):
        """Writes, publishes and prunes one backup (on the background thread if async)."""
        start = time.perf_counter()
        try:
            path = self._store.write(global_step, meta, shards)
            self._policy.published(global_step, time.perf_counter() - start)
            self._store.prune(global_step)
        except (OSError, tf.errors.OpError) as e:  # OpError: a placed shard's write failed
            where = getattr(e, "filename", None) or self.backup_dir
            why = (
                getattr(e, "strerror", None)
                or getattr(e, "message", None)
                or (str(e.args[0]) if e.args else type(e).__name__)
            )
            newest = self._store.published()
            kept = os.path.join(self.backup_dir, newest[0]) if newest else "none"
            raise BackupWriteError(
                f"Could not write the backup of step {global_step} to {where!r}: "
                f"{why}. The last backup is kept ({kept}). Expected a writable "
                "`backup_dir` with room for a backup."
            ) from None
        _log.info(
            "tfscale: %s backup %s (epoch %d, step %d, global step %d)",
            reason,
            path,
            *position,
            global_step,
        )

    def _check_compatible(self, backup):
        meta = backup.meta
        model_vars, opt_vars = self._variables()
        optimizer = type(self.model.optimizer).__name__ if self.model.optimizer else None
        if meta["optimizer"] != optimizer:
            raise self._mismatch(
                backup, f"optimizer {meta['optimizer']!r:.80} in the backup, {optimizer} here"
            )
        for kind, saved, current in (
            ("variable", meta["model"], model_vars),
            ("optimizer variable", meta["optimizer_variables"], opt_vars),
        ):
            if len(saved) != len(current):
                raise self._mismatch(backup, f"{len(saved)} {kind}s in the backup, {len(current)} here")
            for i, ((name, shape, dtype), v) in enumerate(zip(saved, current)):
                if (
                    shape != self._shape(v)
                    or dtype != str(v.dtype)
                    or _structural_name(name) != _structural_name(v.path)
                ):
                    raise self._mismatch(
                        backup,
                        f"{kind} {i} is {name!r:.80} {tuple(shape)} {dtype:.20} in the backup, "
                        f"{v.path!r} {tuple(self._shape(v))} {v.dtype} here",
                    )

    def _mismatch(self, backup, detail):
        return BackupMismatchError(
            f"Backup {backup.path} was made by a different model ({detail}); nothing was loaded. "
            "Expected the same model and optimizer, or a fresh `backup_dir`."
        )

    def _check_job(self, backup):
        """`check` for the store: consistent, and this job's (before any shard is trusted)."""
        _check_consistent(backup)
        theirs = backup.meta.get("job_id", self.job_id)  # format 1-2 backups have none
        if theirs != self.job_id:
            raise BackupInUseError(
                f"Backup {backup.path} belongs to job_id={theirs!r:.80}, this job is "
                f"job_id={self.job_id!r:.80}; nothing was loaded. Expected this job's own "
                "`backup_dir` (or pass the same `job_id` to resume that job)."
            )

    _uniform_steps = True  # every epoch of the run had this fit's steps (not so when resized)

    def _check_in_range(self, backup):
        """Raises `BackupError` unless the backup's position fits this `fit` (epochs, steps)."""
        meta, params = backup.meta, self.params or {}
        epochs, steps = params.get("epochs"), params.get("steps")
        epoch, step, position = meta["epoch"], meta["step"], meta["input"]
        spe = self._tracker.steps_per_execution if self._tracker is not None else 1
        # An epoch's steps as the callback counts them (a last, partial execution counts whole).
        span = math.ceil(steps / spe) * spe if type(steps) is int else None
        problem = None
        if type(epochs) is int and (epoch > epochs or (epoch == epochs and step)):
            problem = f"epoch {epoch} (step {step}), beyond this fit's epochs={epochs}"
        elif span is not None and step > span:
            problem = f"step {step} of epoch {epoch}, beyond this fit's {steps} steps per epoch"
        elif self._uniform_steps and step > meta["global_step"]:
            problem = f"step {step} of epoch {epoch}, beyond its global step {meta['global_step']}"
        elif span is not None and step and self._uniform_steps and epoch * span + step != meta["global_step"]:
            # Mid-epoch, the position must be where this data puts it (epoch-end backups
            # may resume on other data).
            problem = (
                f"global step {meta['global_step']} = epoch {epoch}, step {step} ({steps} steps per epoch)"
            )
        elif position["iterators_made"] > 2 * epoch + 4:
            problem = f"{position['iterators_made']} input iterators made by epoch {epoch}"
        elif type(steps) is int and position["batches_taken"] > (epoch + 1) * steps + spe:
            problem = f"{position['batches_taken']} batches taken by epoch {epoch} of {steps} steps"
        if problem:
            raise BackupError(
                f"Backup {backup.path} is at {problem}; nothing was loaded. Expected a backup of "
                "this training (same data and epochs), or a fresh `backup_dir`."
            )

    def _restore(self, backup):
        # Every check comes before the first assignment: a restore loads all or nothing.
        self._check_compatible(backup)
        self._check_in_range(backup)
        meta = backup.meta
        if self._tracker is None and meta["step"]:
            raise BackupError(
                f"Backup {backup.path} is from the middle of epoch {meta['epoch']} (step {meta['step']}), "
                "but this `fit` gives no access to its input (not the TensorFlow backend's `fit`, or a "
                "Keras whose internals tfscale.compat.keras_fit_position does not support). "
                "Expected `save_freq='epoch'` backups here."
            )
        model_vars, opt_vars = self._variables()
        count = len(model_vars) + len(opt_vars)
        for v, value in zip(model_vars + opt_vars, backup.arrays[:count], strict=True):
            if self._full_shape(v) is not None:  # cut into this job's shards, however many replicas
                keras_optimizer_zero.assign_full(v, value)
            else:
                v.assign(value)
        self._epoch, self._step, self._global_step = meta["epoch"], meta["step"], meta["global_step"]
        self._last_saved = self._global_step
        if self._tracker is not None:
            position = {k: meta["input"][k] for k in ("iterators_made", "live", "batches_taken")}
            if self._tracker.resume(step=self._step, **position):
                # Taken at the last step of its epoch: nothing of it is left to run.
                self._epoch, self._step = self._epoch + 1, 0
        if self._step and "metric_variables" in meta:
            # Mid-epoch: Keras resets the metrics as the resumed epoch begins; they are
            # put back after that (`on_epoch_begin`). Older backups hold none: as before.
            self._pending_metrics = _backup_metrics.PendingMetrics(
                self._epoch, meta["metric_variables"], backup.arrays[count:], _structural_name
            )
        keras_fit_position.set_initial_epoch(self.model, self._epoch)
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

    def _check_backup_dir(self):
        """One line for a `backup_dir` that cannot be used; notes foreign files once."""
        path = self.backup_dir
        if os.path.exists(path) and not os.path.isdir(path):
            raise BackupWriteError(
                f"Invalid `backup_dir={path!r}`: it exists and is not a directory. "
                "Expected a directory path (new or existing)."
            )
        if self._task.is_writer:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as e:
                raise BackupWriteError(
                    f"Cannot create `backup_dir={path!r}`: {e.strerror or e}. Expected a writable path."
                ) from None
            if not os.access(path, os.W_OK | os.X_OK):
                raise BackupWriteError(
                    f"Cannot write to `backup_dir={path!r}` (read-only or not permitted). "
                    "Expected a writable directory."
                )
        self._take_lock()
        foreign = self._store.foreign()
        if foreign:
            _log.info(
                "tfscale: backup_dir %s also holds %d entries tfscale did not write (%s); "
                "they are left untouched",
                path,
                len(foreign),
                ", ".join(repr(n) for n in foreign[:3]) + (", ..." if len(foreign) > 3 else ""),
            )

    def _take_lock(self):
        """The writer locks `backup_dir` before anything in it is read; the others follow it."""
        self._lock = DirectoryLock(self.backup_dir, self.job_id)
        holder = None
        if self._task.is_writer:
            try:
                self._lock.acquire()
            except LockHeldError as e:
                holder = e.holder
            except OSError as e:
                holder = f"a lock file tfscale cannot open ({e.strerror or e})"
        if self._multi_worker:
            taken = _backup_cluster.from_writer(self.model.distribute_strategy, self._task.is_writer)(
                0.0 if holder else 1.0
            )
            if taken != 1.0 and holder is None:
                holder = "another job (its writer, the chief or worker 0, could not lock it)"
        if holder is not None:
            raise BackupInUseError(
                f"`backup_dir={self.backup_dir!r}` is in use by another live job ({holder}); nothing "
                "in it was read or changed. Expected one job per `backup_dir`: give this job its own."
            )

    def on_train_begin(self, logs=None):
        if getattr(self, "_preemption", None) is not None:
            self._preemption.close()  # left by a `fit` that raised (no `on_train_end`)
            self._preemption = None
        strategy = self.model.distribute_strategy
        self._task = ClusterSpec.of_process(strategy)  # who am I: who writes, my label
        self._multi_worker = (self._task.num_workers or 1) > 1 and isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        )
        self._epoch, self._step, self._global_step, self._last_saved = 0, 0, 0, None
        self.restored_from = None
        self._pending_metrics = None
        self._ensure_built()
        # A `fit` that raised may have left a write in flight (this callback's or
        # another one's on the same directory): look for backups only once it is done.
        self._writer.wait()
        error = self._writer.take_error()
        if error is not None:  # no training thread is left to raise it: that backup is absent
            _log.warning("tfscale: the last background backup of the previous fit failed: %s", error)
        wait_for_directory(self.backup_dir, current=self._writer)
        self._check_backup_dir()
        epoch_iterator = keras_fit_position.find_epoch_iterator(self.model)
        self._tracker = None
        if epoch_iterator is not None:
            self._tracker = keras_fit_position.InputTracker(epoch_iterator)
            # A `fit` that raises would otherwise keep its tf.data iterator in Keras's own
            # reference cycle until a full garbage collection (see the compat module).
            keras_fit_position.release_input_after_fit(self.model, epoch_iterator)
        backup, _ = self._store.load_newest(check=self._check_job)
        if self._multi_worker and not _backup_cluster.all_agree(
            strategy, backup.meta["global_step"] if backup else -1
        ):
            raise BackupError(
                f"Workers found different backups in `backup_dir={self.backup_dir!r}` "
                f"({self._task.task_label} found {backup.path if backup else 'none'}). "
                "Expected a directory every worker can read."
            )
        if backup is not None:
            self._restore(backup)
        self._snapshot_function()
        self._policy = SavePolicy(self.save_freq, self.async_save)
        self._policy.start(self._global_step)  # the newest backup on disk (or the start)
        if self._policy.bounded and self._multi_worker:
            self._agree = _backup_cluster.from_writer(strategy, self._task.is_writer)
        self._preemption = None
        if self.save_before_preemption:
            self._preemption = PreemptionWatch(
                strategy,
                multi_worker=self._multi_worker,
                # Synchronous: the process exits only after this backup is published.
                save_fn=lambda: self._save(reason="preemption", sync=True),
                unused_dir=os.path.join(self.backup_dir, ".tf-preemption-unused"),
                in_fit=lambda frame, model=self.model: keras_fit_position.fit_on_stack(model, frame),
            )

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self._epoch:
            self._epoch, self._step = epoch, 0
        # `fit` has just reset the metrics (`reset_metrics` runs before `on_epoch_begin`).
        pending = self._pending_metrics
        if pending is not None and pending.restore(self.model, epoch, self._tracker.element_spec()):
            self._pending_metrics = None

    def on_train_batch_begin(self, batch, logs=None):
        self._begin = batch
        self._begin_time = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        if self._writer.error is not None:
            self._raise_write_error()  # the background write of an earlier backup failed
        done = batch - self._begin + 1
        before = self._global_step
        self._step = batch + 1
        self._global_step += done
        self._save_if_due(before, done)
        if self._preemption is not None:
            self._preemption.step_done()

    def _save_if_due(self, before, done):
        """Asks the save policy (tfscale/_save_policy.py) after `done` steps from `before`."""
        policy = self._policy
        if policy.bounded:
            policy.steps_done((time.perf_counter() - self._begin_time) / done)
        if policy.due(before, self._global_step, done, self._last_saved):
            lag = policy.lag()
            self._save()
            if policy.bounded:
                if self._multi_worker:
                    lag = round(self._agree(lag))  # every worker snapshots at the same steps
                policy.scheduled(self._global_step, done, lag)
        if self._task.is_writer and policy.must_wait(self._global_step, done):
            self._writer.wait()  # the write in flight is of this or a newer enough step
            self._raise_write_error()

    def on_epoch_end(self, epoch, logs=None):
        self._epoch, self._step = epoch + 1, 0
        if self._policy.at_epoch_end():
            self._save(at_epoch_end=True)

    def on_train_end(self, logs=None):
        if self._preemption is not None:
            self._preemption.close()
            self._preemption = None
        if self._tracker is not None:
            self._tracker.close()
        keras_fit_position.set_initial_epoch(self.model, None)
        self._writer.wait()  # `fit` returns only after its last backup is published
        self._raise_write_error()
        if self.delete_checkpoint and self._task.is_writer:
            self._store.remove_all()
        self._lock.release(remove=True)  # a `fit` that raised keeps it until the next `fit` or exit
        if self.delete_checkpoint and self._task.is_writer:
            try:
                os.rmdir(self.backup_dir)  # only if that left it empty
            except OSError:
                pass
