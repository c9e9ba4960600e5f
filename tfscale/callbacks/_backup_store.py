"""On-disk backups: one directory per backup, written aside and published by one rename.

Layout of `backup_dir`:

    ckpt-000000000120/          a published backup (120 = global step it resumes at)
        state.npz               variable values, in model / optimizer order
        manifest.json           written last: metadata + size and sha256 of state.npz
    .tmp-ckpt-...               a backup being written (or left by a crash; removed later)
    rejected-ckpt-...           a backup that failed verification, kept for inspection

A backup is usable only if its manifest parses and `state.npz` has the recorded size
and sha256, so a torn or truncated backup is never loaded. Nothing here imports
TensorFlow: the store deals in numpy arrays and JSON-able metadata.
"""

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import uuid

import numpy as np

from tfscale.errors import Error

__all__ = ["BackupStore", "LoadedBackup", "UnusableBackupError"]

_log = logging.getLogger("tfscale")

FORMAT_VERSION = 1
_PREFIX = "ckpt-"
_TMP_PREFIX = ".tmp-"
_REJECTED_PREFIX = "rejected-"
_STATE = "state.npz"
_MANIFEST = "manifest.json"


class UnusableBackupError(Error, OSError):
    """A backup directory that is torn, truncated or corrupt (never loaded)."""


@dataclasses.dataclass(frozen=True)
class LoadedBackup:
    """A verified backup: its directory, metadata and arrays (in saved order)."""

    path: str
    meta: dict
    arrays: list


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_synced(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


class BackupStore:
    """Writes, verifies, lists and prunes the backups in one directory.

    Args:
        directory: the backup directory (created on first write).
        max_to_keep: how many published backups to keep (>= 1).
    """

    def __init__(self, directory, max_to_keep):
        self.directory = directory
        self.max_to_keep = max_to_keep

    def name(self, step):
        return f"{_PREFIX}{step:012d}"

    def published(self):
        """Published backup names, newest (highest step) first."""
        if not os.path.isdir(self.directory):
            return []
        names = [
            n for n in os.listdir(self.directory) if n.startswith(_PREFIX) and n[len(_PREFIX) :].isdigit()
        ]
        return sorted(names, reverse=True)

    def step_of(self, name):
        return int(name[len(_PREFIX) :])

    def write(self, step, meta, arrays):
        """Writes a backup aside, then publishes it with one rename; returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(
            self.directory, f"{_TMP_PREFIX}{self.name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        os.mkdir(tmp)
        state_path = os.path.join(tmp, _STATE)
        _write_synced(state_path, lambda f: np.savez(f, *arrays))
        manifest = {
            "format": FORMAT_VERSION,
            "meta": meta,
            "files": {_STATE: {"size": os.path.getsize(state_path), "sha256": _sha256(state_path)}},
        }
        payload = json.dumps(manifest, indent=1, sort_keys=True).encode()
        _write_synced(os.path.join(tmp, _MANIFEST), lambda f: f.write(payload))
        _fsync_dir(tmp)
        final = os.path.join(self.directory, self.name(step))
        self._publish(tmp, final)
        return final

    def _publish(self, tmp, final):
        # rename(2) onto a non-empty directory fails, so an existing backup of the
        # same step (identical, or torn) is moved aside first and removed after.
        aside = None
        if os.path.exists(final):
            aside = os.path.join(self.directory, f"{_TMP_PREFIX}old-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
        os.rename(tmp, final)
        _fsync_dir(self.directory)
        if aside:
            shutil.rmtree(aside, ignore_errors=True)

    def prune(self, newest_step):
        """After publishing `newest_step`: drop stale temp dirs, newer (abandoned) and old backups."""
        for name in os.listdir(self.directory):
            if name.startswith(_TMP_PREFIX):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        kept = 0
        for name in self.published():
            step = self.step_of(name)
            if step > newest_step:
                # Only a rejected or abandoned timeline can be ahead of what we just wrote.
                self.reject(name, "it is ahead of the backup just published")
            elif kept < self.max_to_keep:
                kept += 1
            else:
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def reject(self, name, reason):
        """Moves an unusable backup out of the candidates (kept for inspection)."""
        src = os.path.join(self.directory, name)
        if os.path.exists(src):
            dst = os.path.join(self.directory, f"{_REJECTED_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
            os.rename(src, dst)
            _log.warning("tfscale: moved backup %s aside to %s (%s)", src, dst, reason)

    def load(self, name):
        """Verifies and loads one backup. Raises `UnusableBackupError` if it is torn."""
        path = os.path.join(self.directory, name)
        try:
            with open(os.path.join(path, _MANIFEST), "rb") as f:
                manifest = json.loads(f.read().decode())
            expected = manifest["files"][_STATE]
            state_path = os.path.join(path, _STATE)
            size = os.path.getsize(state_path)
            if size != expected["size"]:
                raise UnusableBackupError(f"{_STATE} has {size} bytes, manifest says {expected['size']}")
            if _sha256(state_path) != expected["sha256"]:
                raise UnusableBackupError(f"{_STATE} does not match its sha256 in the manifest")
            with np.load(state_path, allow_pickle=False) as npz:
                arrays = [npz[f"arr_{i}"] for i in range(len(npz.files))]
            if manifest["format"] != FORMAT_VERSION:
                raise UnusableBackupError(f"format {manifest['format']}, expected {FORMAT_VERSION}")
        except UnusableBackupError:
            raise
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UnusableBackupError(f"{type(e).__name__}: {e}") from None
        return LoadedBackup(path=path, meta=manifest["meta"], arrays=arrays)

    def load_newest(self):
        """The newest usable backup (falling back over torn ones, with a log line), or None.

        Returns:
            `(LoadedBackup or None, [rejected names])`.

        Raises:
            UnusableBackupError: backups exist but none of them is usable.
        """
        names = self.published()
        rejected = []
        for name in names:
            try:
                backup = self.load(name)
            except UnusableBackupError as e:
                rejected.append(name)
                _log.warning(
                    "tfscale: backup %s is unusable (%s); falling back to the previous backup",
                    os.path.join(self.directory, name),
                    e,
                )
                continue
            if rejected:
                _log.warning("tfscale: restoring from %s instead of %s", backup.path, ", ".join(rejected))
            return backup, rejected
        if rejected:
            raise UnusableBackupError(
                f"No usable backup in `backup_dir={self.directory!r}`: all {len(rejected)} are torn or "
                "corrupt. Expected at least one complete backup (keep more with `max_to_keep`), or "
                "remove the directory to start over."
            )
        return None, []

    def remove_all(self):
        shutil.rmtree(self.directory, ignore_errors=True)
