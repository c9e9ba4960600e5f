"""TensorFlow gap: `PreemptionCheckpointHandler` stops its watcher threads only when collected.

`tf.distribute.experimental.PreemptionCheckpointHandler` starts a thread that polls for
a termination notice (and, multi-worker, one that watches its peers) and has no public
way to stop them: only `__del__` calls `_stop_poll_termination_signal_thread` and
`_stop_cluster_wise_termination_watcher_thread`. A callback that makes one handler per
`fit` would otherwise leave a polling thread per call behind (no upstream issue filed
as of TF 2.21; same code since TF 2.12). Checked on TF 2.12 to 2.21.

Gate: both methods present; otherwise the threads are left to `__del__` (they are
daemons, so exit is not blocked) and this is a no-op that returns False.
tests/test_compat_backup.py fails when the methods stop stopping the threads.
"""

__all__ = ["CHECKED_ON", "stop_watcher_threads"]

CHECKED_ON = ("2.12", "2.21")
_STOPPERS = ("_stop_poll_termination_signal_thread", "_stop_cluster_wise_termination_watcher_thread")


def stop_watcher_threads(handler):
    """Stops `handler`'s watcher threads now; False where this TF has no such methods."""
    stoppers = [getattr(handler, name, None) for name in _STOPPERS]
    if not all(callable(stop) for stop in stoppers):
        return False
    for stop in stoppers:
        stop()
    return True
