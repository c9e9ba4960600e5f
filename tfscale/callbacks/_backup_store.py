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

The directory may hold other files (it may be the user's `model_dir`): the store only
ever removes entries it recognises as its own -- a name of the forms above and no file
in it but `state.npz` and `manifest.json` -- and it removes those file by file, so
anything else put inside one survives (the directory then stays).
"""

import dataclasses
import hashlib
import json
import logging
import os
import re
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
_OWN_FILES = frozenset((_STATE, _MANIFEST))
_PUBLISHED = re.compile(r"ckpt-[0-9]{12,}")
# Temporary entries: a backup being written (`write`) or an old one moved aside (`_publish`).
_TEMPORARY = re.compile(r"\.tmp-(ckpt-[0-9]{12,}-[0-9]+|old)-[0-9a-f]{8}")
_REJECTED = re.compile(r"rejected-ckpt-[0-9]{12,}-[0-9a-f]{8}")


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


def _holds_only_own_files(path):
    try:
        return os.path.isdir(path) and not os.path.islink(path) and set(os.listdir(path)) <= _OWN_FILES
    except OSError:
        return False


def _remove_own(path):
    """Removes one of the store's entries file by file; True if it is gone."""
    for name in _OWN_FILES:
        try:
            os.unlink(os.path.join(path, name))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(path)  # fails, and keeps it, if anything else was put inside
    except OSError as e:
        _log.warning("tfscale: left %s in place (%s)", path, e.strerror)
        return False
    return True


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
        names = [n for n in self._entries() if _PUBLISHED.fullmatch(n) and self._own(n)]
        return sorted(names, key=self.step_of, reverse=True)

    def _entries(self):
        try:
            return os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _own(self, name):
        return _holds_only_own_files(os.path.join(self.directory, name))

    def is_own(self, name):
        """Whether `name` (an entry of the directory) is one the store wrote."""
        if _PUBLISHED.fullmatch(name) or _TEMPORARY.fullmatch(name):
            return self._own(name)
        return bool(_REJECTED.fullmatch(name))

    def foreign(self):
        """Entries of the directory the store did not write (it never touches them)."""
        return sorted(n for n in self._entries() if not self.is_own(n))

    def step_of(self, name):
        return int(name[len(_PREFIX) :])

    def write(self, step, meta, arrays):
        """Writes a backup aside, then publishes it with one rename; returns its path."""
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(
            self.directory, f"{_TMP_PREFIX}{self.name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        os.mkdir(tmp)
        try:
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
        except BaseException as e:
            # A full disk must not also keep the half-written copy; the last backup stays.
            _remove_own(tmp)
            if isinstance(e, OSError) and e.filename is None:
                e.filename = tmp  # a failed write() says "[Errno 28]" but not where
            raise
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
            _remove_own(aside)

    def prune(self, newest_step):
        """After publishing `newest_step`: drop stale temp dirs, newer (abandoned) and old backups."""
        for name in self._entries():
            if _TEMPORARY.fullmatch(name) and self._own(name):
                _remove_own(os.path.join(self.directory, name))
        kept = 0
        for name in self.published():
            step = self.step_of(name)
            if step > newest_step:
                # Only a rejected or abandoned timeline can be ahead of what we just wrote.
                self.reject(name, "it is ahead of the backup just published")
            elif kept < self.max_to_keep:
                kept += 1
            else:
                _remove_own(os.path.join(self.directory, name))

    def reject(self, name, reason):
        """Moves an unusable backup out of the candidates (kept for inspection)."""
        src = os.path.join(self.directory, name)
        if os.path.exists(src):
            dst = os.path.join(self.directory, f"{_REJECTED_PREFIX}{name}-{uuid.uuid4().hex[:8]}")
            os.rename(src, dst)
            _log.warning("tfscale: moved backup %s aside to %s (%s)", src, dst, reason)

    def load(self, name, check=None):
        """Verifies and loads one backup. Raises `UnusableBackupError` if it is torn.

        `check(backup)`, if given, vets the loaded metadata and arrays further and
        raises `UnusableBackupError` for a backup that is inconsistent in itself.
        """
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
                raise UnusableBackupError(f"format {manifest['format']!r:.50}, expected {FORMAT_VERSION}")
            backup = LoadedBackup(path=path, meta=manifest["meta"], arrays=arrays)
        except UnusableBackupError:
            raise
        # RecursionError: a manifest nested deeper than the JSON parser can follow.
        except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, MemoryError) as e:
            raise UnusableBackupError(f"{type(e).__name__}: {str(e)[:200]}") from None
        if check is not None:
            check(backup)
        return backup

    def load_newest(self, check=None):
        """The newest usable backup (falling back over torn ones, with a log line), or None.

        `check`: as for `load`.

        Returns:
            `(LoadedBackup or None, [rejected names])`.

        Raises:
            UnusableBackupError: backups exist but none of them is usable.
        """
        names = self.published()
        rejected = []
        for name in names:
            try:
                backup = self.load(name, check)
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
                "remove its ckpt-* backups to start over."
            )
        return None, []

    def remove_all(self):
        """Removes the store's published and temporary backups, and nothing else.

        Rejected backups stay for inspection; the directory itself goes only if that
        leaves it empty (`rmdir` cannot remove anything else).
        """
        for name in self._entries():
            if (_PUBLISHED.fullmatch(name) or _TEMPORARY.fullmatch(name)) and self._own(name):
                _remove_own(os.path.join(self.directory, name))
        try:
            os.rmdir(self.directory)
        except OSError:
            pass
