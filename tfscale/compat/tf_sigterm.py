"""TensorFlow gap: its coordination agent takes SIGTERM away from the process for good.

When `MultiWorkerMirroredStrategy` starts TensorFlow's coordination service agent, the
agent creates a preemption notifier (`SigtermNotifier`, xla/tsl
`distributed_runtime/preemption/preemption_notifier.cc`) that installs a C++ SIGTERM
handler with `std::signal` from a runtime thread. The handler only records the signal
for `PreemptionCheckpointHandler`: a process that was told to stop while it waits for
its peers (TensorFlow's blocking init) or before any handler of its own is installed
then ignores SIGTERM for good. No upstream issue tracks this as of TF 2.21.
Checked on TF 2.16 to 2.21.

`SigtermDefault` keeps SIGTERM's action at the default (terminate) while TensorFlow
starts: a thread puts it back through libc's `signal()` every 50 ms (Python's
`signal.signal` works only from the main thread, which is blocked in TensorFlow's init),
and once more on exit. A Python handler someone else installed is theirs to keep: then
it does nothing. Gate: `available()`, a C library with `signal()` (glibc, musl, macOS);
otherwise the context does nothing. tests/test_compat.py checks that a C-level handler
installed inside the context is replaced by the default action (the process dies of a
real SIGTERM), and tests/test_peers.py that `tfscale-train` still ends on SIGTERM while
it waits for its peers.
"""

import ctypes
import signal
import threading

__all__ = ["CHECKED_ON", "SigtermDefault", "available"]

CHECKED_ON = ("2.16", "2.21")
_WATCH_SECONDS = 0.05


def _libc():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    return libc


def available():
    """The gate: this process's C library has `signal()`."""
    return _libc() is not None


class SigtermDefault:
    """Context: SIGTERM's action stays the default (terminate) while TensorFlow may replace it."""

    def __init__(self):
        self._done = threading.Event()
        self._libc = _libc()
        self._thread = threading.Thread(target=self._watch, name="tfscale-sigterm", daemon=True)

    def _reset(self):
        self._libc.signal(signal.SIGTERM, ctypes.c_void_p(0))  # SIG_DFL

    def _watch(self):
        while not self._done.wait(_WATCH_SECONDS):
            self._reset()

    def __enter__(self):
        if self._libc is not None and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        if self._thread.is_alive():
            self._thread.join()
            self._reset()
        return False
