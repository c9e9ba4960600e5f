"""One job per `backup_dir`: an advisory lock held by the writing task for the life of `fit`.

Two live jobs writing and pruning one directory would mix their state (each resumes
from, and prunes, the other's backups). The writer of a job takes `flock(LOCK_EX)` on
`backup_dir/.tfscale-lock` before it reads anything there, and records who it is in
that file. The kernel drops an flock when its holder dies, however it dies (SIGKILL
included): a dead holder is provably dead, and a restart takes the lock over with no
stale-lock guessing. The other tasks of a multi-worker job do not lock: they follow
their writer (the callback tells them its answer), so the workers of one job share it.

The lock stays with the process until `release` (at the end of `fit`) or exit; a later
`fit` in the same process on the same directory (after one that raised) reuses it.
Network file systems: NFSv4 and Lustre map flock onto their own locks; on a file
system without locks `flock` fails and the job runs unlocked, with one warning.
"""

import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time

from tfscale.callbacks._backup_store import LOCK_NAME, UnusableBackupError, read_bounded
from tfscale.errors import Error

__all__ = ["LOCK_NAME", "DirectoryLock", "LockHeldError"]

_log = logging.getLogger("tfscale")

_held = {}  # realpath of backup_dir -> (fd, holder) held by this process
_guard = threading.Lock()


class LockHeldError(Error):
    """Another live process holds the lock; `holder` says who (from the lock file).

    Internal: `BackupAndRestore` turns it into `BackupInUseError` naming the holder.
    """

    def __init__(self, holder):
        super().__init__(holder)
        self.holder = holder


def _describe(path):
    try:
        info = json.loads(read_bounded(path, 4096).decode())
        return (
            f"pid {int(info['pid'])} on {str(info['host'])[:80]}, job_id={info.get('job_id')!r:.80}, "
            f"since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(float(info['since'])))}"
        )
    except (OSError, ValueError, KeyError, TypeError, OverflowError, UnusableBackupError):
        return "a process that left no readable record"


class DirectoryLock:
    """The lock of one backup directory.

    Args:
        directory: the backup directory (must exist).
        job_id: recorded in the lock file for the message another job gets.
    """

    def __init__(self, directory, job_id=None):
        self.path = os.path.join(directory, LOCK_NAME)
        self._key = os.path.realpath(directory)
        self.job_id = job_id

    def acquire(self):
        """Takes the lock (or keeps it, if this process holds it). Raises `LockHeldError`."""
        with _guard:
            if self._key in _held:
                return
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            fd = os.open(self.path, flags, 0o644)
            try:
                if not os.path.samestat(os.fstat(fd), os.lstat(self.path)) or not _regular(fd):
                    raise LockHeldError(f"{self.path} is not a regular file tfscale made")
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise LockHeldError(_describe(self.path)) from None
                except OSError as e:  # no locks on this file system
                    _log.warning("tfscale: cannot lock %s (%s); running without the lock", self.path, str(e))
                info = {"pid": os.getpid(), "host": socket.gethostname(), "job_id": self.job_id,
                        "since": time.time()}  # fmt: skip
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(info).encode(), 0)
            except BaseException:
                os.close(fd)
                raise
            _held[self._key] = fd

    def release(self, remove=False):
        """Drops the lock (if held here); `remove`: also unlinks the lock file first."""
        with _guard:
            fd = _held.pop(self._key, None)
            if fd is None:
                return
            if remove:
                try:
                    os.unlink(self.path)
                except OSError:
                    pass
            os.close(fd)  # closing the last descriptor drops the flock


def _regular(fd):
    return stat.S_ISREG(os.fstat(fd).st_mode)
