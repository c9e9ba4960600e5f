"""SIGTERM -> a backup at the same step on every worker -> exit with `RESTART_EXIT_CODE`.

Built on `tf.distribute.experimental.PreemptionCheckpointHandler`, which is made for
this: it installs the SIGTERM handler, and under `MultiWorkerMirroredStrategy` the
worker that got the signal agrees with its peers through the coordination service on
the step after which all of them save. Its `TerminationConfig(save_fn=...)` replaces
its own checkpoint writing with our backup, and `exit_fn` exits with our code. The
handler still wants a `tf.train.CheckpointManager`: it gets an empty one whose
directory is never written.

SIGTERM must end the process whenever no `fit` is running. Keras calls no callback
hook when `fit` raises, so `close` (from `on_train_end`) may never run. The SIGTERM
handler installed here therefore checks, when a signal comes, whether the `fit` it
was made for is still on the interrupted stack (a signal handler runs on top of the
main thread's frames): if not, the watch closes itself and the signal goes to the
handler that was there before (by default: the process ends). Checking at signal time
needs no wrapping of `fit` (which users call directly) and costs nothing per step;
the next `fit`'s watch also closes a stale one first, so it never saves a tfscale
handler as "previous".
"""

import inspect
import os
import signal
import sys

import tensorflow as tf

from tfscale.compat import tf_platform_probe, tf_preemption_threads

__all__ = ["RESTART_EXIT_CODE", "PreemptionWatch"]

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". `tfscale-launch` and
# supervisors treat it as "restart me"; 1 and signals stay real failures.
RESTART_EXIT_CODE = 75

_open_watches = []  # watches not yet closed, oldest first


class PreemptionWatch:
    """Saves a backup at the next step boundary after SIGTERM, then exits.

    Args:
        strategy: the model's `tf.distribute` strategy.
        multi_worker: True under a multi-worker cluster (the handler then agrees on
            the step with its peers).
        save_fn: called with no argument on every worker at the agreed step.
        unused_dir: a directory path the handler's empty checkpoint manager is given.
        in_fit: `in_fit(frame)` is True while the `fit` this watch serves is running
            on the stack of `frame`.
    """

    def __init__(self, strategy, *, multi_worker, save_fn, unused_dir, in_fit):
        here = inspect.currentframe()
        stale = [w for w in _open_watches if not w._in_fit(here)]
        # A frame that holds itself (`here`) is a reference cycle: it would keep every
        # caller's frame (fit's input among their locals) alive until a full collection.
        del here
        for watch in stale:
            watch.close()  # its `fit` raised: Keras never called `on_train_end`
        self._in_fit = in_fit
        resolver = strategy.cluster_resolver if multi_worker else None
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), directory=unused_dir, max_to_keep=1)
        config = tf.distribute.experimental.TerminationConfig(
            exit_fn=self._exit, save_fn=save_fn, grace_period=0
        )
        tf_platform_probe.probe_once()  # TF's per-handler HTTP probe leaves a cycle (see there)
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            resolver, manager, termination_config=config
        )
        self._tf_sigterm = signal.getsignal(signal.SIGTERM)  # what the handler installed
        signal.signal(signal.SIGTERM, self._on_sigterm)
        _open_watches.append(self)

    def _on_sigterm(self, signum, frame):
        if self._in_fit(frame):
            self._tf_sigterm(signum, frame)
            return
        previous = self._previous_handler
        self.close()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            os.kill(os.getpid(), signum)  # the default action, now that it is back

    def _exit(self):
        # The watcher threads are left to the handler's `__del__` here: stopping the peer
        # watcher talks to the coordination service, which peers are leaving too.
        self._release_signal()
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(RESTART_EXIT_CODE)

    def step_done(self):
        """Call once per train step (execution) on every worker; may save and exit."""
        if self._handler is not None:
            self._handler.save_checkpoint_if_preempted()

    def close(self):
        """Stops the handler's watcher threads and gives SIGTERM back its old handler."""
        handler, self._handler = self._handler, None
        if handler is None:
            return
        self._release_signal()
        tf_preemption_threads.stop_watcher_threads(handler)

    def _release_signal(self):
        if self in _open_watches:
            _open_watches.remove(self)
        # Put back the previous handler unless someone replaced ours in the meantime.
        if signal.getsignal(signal.SIGTERM) in (self._on_sigterm, self._tf_sigterm):
            signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
