"""One background thread at a time writes a backup; the training thread only hands it a copy.

`BackupAndRestore(async_save=True)` snapshots the state to host memory on the training
thread and gives the write (hash, write, fsync, rename, prune) to a `BackgroundWriter`.
At most one write is in flight: the next backup waits for it before taking its snapshot,
so at most one extra copy of the state exists and no due backup is skipped (skipping
would let more than `save_freq` steps pass between published backups). When the
snapshots are taken, and when a step must wait for a write, is the callback's
business (`BackupAndRestore._save_if_due` and tfscale/_save_policy.py).

A write that raised keeps its exception until the training thread takes it (at the next
step). The thread is not a daemon: when `fit` raises, the write in flight still finishes
(the interpreter waits for it at exit, and the next `fit` on the same directory waits
for it before looking for a backup); a SIGKILL leaves only a `.tmp-` directory, never
published, which the next prune removes.
"""

import logging
import os
import threading
import time

__all__ = ["BackgroundWriter", "wait_for_directory"]

_log = logging.getLogger("tfscale")

_lock = threading.Lock()
_by_directory = {}  # realpath of backup_dir -> the writer that last wrote there


class BackgroundWriter:
    """Runs one write job at a time on its own thread and keeps its error for the caller.

    Args:
        directory: the backup directory it writes to (registered, so that another
            callback on the same directory waits for this writer first).
    """

    def __init__(self, directory):
        self._key = os.path.realpath(directory)
        self._thread = None
        self._failure = None  # (exception, job) of the last write, if it raised
        self.waited_seconds = 0.0  # time the training thread spent waiting for a write
        self.waits = 0  # how many backups found the previous write still in flight

    @property
    def error(self):
        return self._failure[0] if self._failure else None

    def take_failure(self):
        """`(exception, job)` of a failed write (once), or `(None, None)`."""
        failure, self._failure = self._failure, None
        return failure or (None, None)

    def take_error(self):
        """The exception of a failed write (once), or None."""
        return self.take_failure()[0]

    def busy(self):
        return self._thread is not None and self._thread.is_alive()

    def wait(self):
        """Blocks until the write in flight (if any) is done."""
        thread = self._thread
        if thread is None:
            return
        if thread.is_alive():
            start = time.perf_counter()
            thread.join()
            self.waits += 1
            self.waited_seconds += time.perf_counter() - start
        self._thread = None

    def submit(self, job):
        """Starts `job()` on a new thread, after the previous one finished."""
        self.wait()
        thread = threading.Thread(target=self._run, args=(job,), name="tfscale-backup-writer")
        with _lock:
            _by_directory[self._key] = self
        self._thread = thread
        thread.start()

    def _run(self, job):
        try:
            job()
        except BaseException as e:  # kept for the training thread, which raises it
            self._failure = (e, job)


def wait_for_directory(directory, current=None):
    """Waits for another writer's write in flight to `directory` (a `fit` that raised).

    Its error, which no training thread will raise now, is logged instead.
    """
    with _lock:
        writer = _by_directory.get(os.path.realpath(directory))
    if writer is None or writer is current:
        return
    writer.wait()
    error = writer.take_error()
    if error is not None:
        _log.warning("tfscale: the last background backup of an earlier fit failed: %s", error)
