"""On-disk backups: one directory per backup, written aside and published by one rename.

Layout of `backup_dir`:

    ckpt-000000000120/          a published backup (120 = global step it resumes at)
        shard-00000.npz         values of the variables on one device of this process
        shard-00001.tensors     values of the variables of another task, written there
        manifest.json           written last: metadata, each shard's variables, size, checksum
    .tmp-ckpt-...               a backup being written (or left by a crash; removed later)
    rejected-ckpt-...           a backup that failed verification, kept for inspection
    .tfscale-lock               held (flock) by the job writing here (`_backup_lock`)

A backup is usable only if its manifest parses, matches its own sha256 (format 3: the
manifest's content, shard checksums included, is hashed into a `sha256` field beside
it), and every shard it lists has the recorded size and checksum, all checked before
anything is returned (a restore loads all or nothing), so a torn, truncated, edited or
incomplete backup is never loaded. Format 1 and 2 backups (no manifest checksum) still
load. Every read opens a regular file only (never a FIFO, device or symlink) and reads
at most its recorded or bounded size. Nothing here imports TensorFlow: the store writes
and verifies the `.npz` shards itself (sha256); a shard of another kind is an object
that writes itself (`write(path) -> record`) and a reader that verifies it, given by
the caller (`_backup_placed` for the shards written on another task).

The directory may hold other files (it may be the user's `model_dir`): the store only
ever removes or renames entries it can prove it wrote -- a real directory with a name of
the forms above, holding only regular files named `manifest.json`, `state.npz` and
`shard-NNNNN.*`, and (for a published backup) a manifest that verifies -- and it removes
those file by file, so anything else put inside one survives (the directory then stays).
Anything else is left alone and mentioned in one line at most (`foreign`).
"""

import dataclasses
import errno
import hashlib
import json
import logging
import os
import re
import stat
import uuid

import numpy as np

from tfscale.errors import Error

__all__ = ["LOCK_NAME", "BackupStore", "LoadedBackup", "NpzShard", "UnusableBackupError"]

_log = logging.getLogger("tfscale")

# 1: one state.npz; 2: shards listed in the manifest; 3: + its sha256; 4: + the metric
# state (meta `metric_variables`: an older tfscale must refuse it as newer, not as torn).
FORMAT_VERSION = 4
_READABLE_FORMATS = (1, 2, 3, 4)
MANIFEST_LIMIT = 256 << 20  # bytes: ~100 per variable, so millions of variables fit
_PREFIX = "ckpt-"
_TMP_PREFIX = ".tmp-"
_REJECTED_PREFIX = "rejected-"
_STATE = "state.npz"
_MANIFEST = "manifest.json"
LOCK_NAME = ".tfscale-lock"  # `_backup_lock`: the job that holds `backup_dir`
_OWN_FILE = re.compile(r"manifest\.json|state\.npz|shard-[0-9]{5}\.(npz|tensors)")
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
    arrays: list  # numpy arrays, or tensors held on another task (placed shards)


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


def open_regular(path):
    """A binary file object of `path` if it is a regular file; never follows a symlink and
    never blocks on a FIFO or device (those raise `UnusableBackupError`)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnusableBackupError(f"{os.path.basename(path)} is not a regular file")
    return os.fdopen(fd, "rb")


def read_bounded(path, limit):
    """The bytes of the regular file `path`; `UnusableBackupError` if over `limit` bytes."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnusableBackupError(f"{os.path.basename(path)} is over {limit} bytes")
    return data


def _canonical(manifest):
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def seal(manifest):
    """`manifest` with its `sha256` (over everything else in it, shard checksums included)."""
    return {**manifest, "sha256": hashlib.sha256(_canonical(manifest)).hexdigest()}


def parse_manifest(data):
    """The manifest dict of `data` (bytes), its own checksum verified for format 3."""
    manifest = json.loads(data.decode())
    if not isinstance(manifest, dict) or manifest.get("format") not in _READABLE_FORMATS:
        version = manifest.get("format") if isinstance(manifest, dict) else None
        raise UnusableBackupError(
            f"format {version!r:.50}, expected one of {_READABLE_FORMATS} "
            "(made by a newer tfscale: restore it with that version, or start a fresh `backup_dir`)"
        )
    if manifest["format"] >= 3 and manifest.get("sha256") != hashlib.sha256(_canonical(manifest)).hexdigest():
        raise UnusableBackupError("its manifest does not match its own sha256 (edited or corrupt)")
    return manifest


def _is_index(value):
    return type(value) is int and value >= 0


def _write_synced(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _holds_only_own_files(path):
    """A real directory (no symlink) holding only regular files with the store's names."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        return all(
            _OWN_FILE.fullmatch(n) and stat.S_ISREG(os.lstat(os.path.join(path, n)).st_mode)
            for n in os.listdir(path)
        )
    except OSError:
        return False


def _proven_backup(path):
    """Whether `path` is a published backup the store wrote: its files, and a manifest that verifies."""
    try:
        parse_manifest(read_bounded(os.path.join(path, _MANIFEST), MANIFEST_LIMIT))
    except (OSError, ValueError, RecursionError, MemoryError):  # UnusableBackupError is an OSError
        return False
    return _holds_only_own_files(path)


def _remove_own(path):
    """Removes one of the store's entries file by file; True if it is gone."""
    try:
        names = [n for n in os.listdir(path) if _OWN_FILE.fullmatch(n)]
    except OSError:
        names = []
    for name in names:
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


class NpzShard:
    """Host copies of the variables of one device of this process, written as one `.npz`.

    Args:
        device: where the variables live (recorded in the manifest).
        indices: their positions in the backup's variable list.
        arrays: their values (host copies).
    """

    kind = "npz"

    def __init__(self, device, indices, arrays):
        self.device, self.indices, self.arrays = device, list(indices), arrays

    def write(self, path):
        _write_synced(path, lambda f: np.savez(f, *self.arrays))
        return {"size": os.path.getsize(path), "sha256": _sha256(path)}

    @staticmethod
    def read(path, record):
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size != record["size"]:
                raise UnusableBackupError(
                    f"{os.path.basename(path)} has {size} bytes, manifest says {record['size']}"
                )
            digest, left = hashlib.sha256(), size
            while left > 0:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                digest.update(chunk)
                left -= len(chunk)
            if digest.hexdigest() != record["sha256"]:
                raise UnusableBackupError(
                    f"{os.path.basename(path)} does not match its sha256 in the manifest"
                )
            f.seek(0)
            with np.load(f, allow_pickle=False) as npz:
                return [npz[f"arr_{i}"] for i in range(len(npz.files))]


class BackupStore:
    """Writes, verifies, lists and prunes the backups in one directory.

    Args:
        directory: the backup directory (created on first write).
        max_to_keep: how many published backups to keep (>= 1).
        readers: `{kind: read(path, record) -> values}` for shard kinds other than
            `npz`; `read` verifies the shard and raises `UnusableBackupError` if not.
    """

    def __init__(self, directory, max_to_keep, readers=None):
        self.directory = directory
        self.max_to_keep = max_to_keep
        self.readers = {NpzShard.kind: NpzShard.read, **(readers or {})}

    def name(self, step):
        return f"{_PREFIX}{step:012d}"

    def published(self):
        """Published backup names, newest (highest step) first."""
        if not os.path.isdir(self.directory):
            return []
        names = [n for n in self._entries() if _PUBLISHED.fullmatch(n) and self._published(n)]
        return sorted(names, key=self.step_of, reverse=True)

    def _published(self, name):
        # Its files, and a regular manifest.json: an empty `ckpt-*` is someone else's.
        path = os.path.join(self.directory, name)
        return self._own(name) and os.path.isfile(os.path.join(path, _MANIFEST))

    def proven(self, name):
        """Whether `name` is a published backup the store can prove it wrote (manifest verifies)."""
        return _proven_backup(os.path.join(self.directory, name))

    def _entries(self):
        try:
            return os.listdir(self.directory)
        except (FileNotFoundError, NotADirectoryError):
            return []

    def _own(self, name):
        return _holds_only_own_files(os.path.join(self.directory, name))

    def is_own(self, name):
        """Whether `name` (an entry of the directory) is one the store wrote."""
        if _PUBLISHED.fullmatch(name):
            return self._published(name)
        if _TEMPORARY.fullmatch(name):
            return self._own(name)
        if name == LOCK_NAME:
            return os.path.isfile(os.path.join(self.directory, name))
        return bool(_REJECTED.fullmatch(name))

    def foreign(self):
        """Entries of the directory the store did not write (it never touches them)."""
        return sorted(n for n in self._entries() if not self.is_own(n))

    def step_of(self, name):
        return int(name[len(_PREFIX) :])

    def write(self, step, meta, shards):
        """Writes a backup aside, then publishes it with one rename; returns its path.

        `shards`: `NpzShard`s, or objects with the same `kind`, `device`, `indices` and
        `write(path) -> record` (a placed shard writes itself where its variables live).
        """
        os.makedirs(self.directory, exist_ok=True)
        tmp = os.path.join(
            self.directory, f"{_TMP_PREFIX}{self.name(step)}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        os.mkdir(tmp)
        try:
            records = []
            for i, shard in enumerate(shards):
                name = f"shard-{i:05d}.{shard.kind}"
                record = shard.write(os.path.join(tmp, name))
                records.append(
                    {
                        "file": name,
                        "kind": shard.kind,
                        "device": shard.device,
                        "variables": shard.indices,
                        **record,
                    }
                )
            manifest = seal({"format": FORMAT_VERSION, "meta": meta, "shards": records})
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
        try:
            self._publish(tmp, final)
        except OSError:
            if os.path.lexists(tmp):
                _remove_own(tmp)
            raise
        return final

    def _publish(self, tmp, final):
        # rename(2) onto a non-empty directory fails, so an existing backup of the
        # same step (identical, or torn) is moved aside first and removed after.
        aside = None
        # One of ours at this step (its files and a manifest, perhaps torn) is replaced;
        # anything else there (an empty or foreign `ckpt-*`) is not ours to move.
        if os.path.lexists(final) and not (
            _holds_only_own_files(final) and os.path.isfile(os.path.join(final, _MANIFEST))
        ):
            raise FileExistsError(
                errno.EEXIST, "an entry tfscale did not write is in the way (left alone: move it away)", final
            )
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
            if not self.proven(name):
                continue  # not provably ours (its manifest does not verify): left alone
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
            manifest = parse_manifest(read_bounded(os.path.join(path, _MANIFEST), MANIFEST_LIMIT))
            if manifest["format"] == 1:
                arrays = NpzShard.read(os.path.join(path, _STATE), manifest["files"][_STATE])
            else:
                arrays = self._read_shards(path, manifest["shards"])
            backup = LoadedBackup(path=path, meta=manifest["meta"], arrays=arrays)
        except UnusableBackupError:
            raise
        # RecursionError: a manifest nested deeper than the JSON parser can follow.
        except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError, MemoryError) as e:
            raise UnusableBackupError(f"{type(e).__name__}: {str(e)[:200]}") from None
        if check is not None:
            check(backup)
        return backup

    def _read_shards(self, path, records):
        """Every shard verified and read before any value is returned (all or nothing)."""
        arrays = {}
        for record in records:
            name = record["file"]
            if not (isinstance(name, str) and _OWN_FILE.fullmatch(name)):
                raise UnusableBackupError(f"its manifest names an unknown shard file {name!r:.80}")
            if record["kind"] not in self.readers:
                raise UnusableBackupError(
                    f"shard {name} is of kind {record['kind']!r:.50}, which this process cannot read"
                )
            values = self.readers[record["kind"]](os.path.join(path, name), record)
            if len(values) != len(record["variables"]):
                raise UnusableBackupError(
                    f"{name} holds {len(values)} values, manifest says {len(record['variables'])}"
                )
            for index, value in zip(record["variables"], values):
                if not _is_index(index) or index in arrays:
                    raise UnusableBackupError(f"its manifest gives {name} a bad variable index {index!r:.50}")
                arrays[index] = value
        if sorted(arrays) != list(range(len(arrays))):
            raise UnusableBackupError("its shards do not hold every variable once")
        return [arrays[i] for i in range(len(arrays))]

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
                if len(rejected) == 1:  # one line, however many there are
                    _log.warning(
                        "tfscale: backup %s is unusable (%s); falling back to the previous backup",
                        os.path.join(self.directory, name),
                        str(e),  # not `e`: its traceback keeps frames (tests/test_log_records.py)
                    )
                continue
            if rejected:
                _log.warning(
                    "tfscale: restoring from %s instead of %s",
                    backup.path,
                    ", ".join(rejected[:3]) + (f" and {len(rejected) - 3} more" if len(rejected) > 3 else ""),
                )
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
            if (_PUBLISHED.fullmatch(name) and self.proven(name)) or (
                _TEMPORARY.fullmatch(name) and self._own(name)
            ):
                _remove_own(os.path.join(self.directory, name))
        try:
            os.rmdir(self.directory)
        except OSError:
            pass
