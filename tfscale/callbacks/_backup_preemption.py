"""SIGTERM -> a backup at the same step on every worker -> exit with `RESTART_EXIT_CODE`.

Built on `tf.distribute.experimental.PreemptionCheckpointHandler`, which is made for
this: it installs the SIGTERM handler, and under `MultiWorkerMirroredStrategy` the
worker that got the signal agrees with its peers through the coordination service on
the step after which all of them save. Its `TerminationConfig(save_fn=...)` replaces
its own checkpoint writing with our backup, and `exit_fn` exits with our code. The
handler still wants a `tf.train.CheckpointManager`: it gets an empty one whose
directory is never written.
"""

import signal
import sys

import tensorflow as tf

__all__ = ["RESTART_EXIT_CODE", "PreemptionWatch"]

# EX_TEMPFAIL from sysexits.h: "temporary failure, try again". `tfscale-launch` and
# supervisors treat it as "restart me"; 1 and signals stay real failures.
RESTART_EXIT_CODE = 75


class PreemptionWatch:
    """Saves a backup at the next step boundary after SIGTERM, then exits.

    Args:
        strategy: the model's `tf.distribute` strategy.
        multi_worker: True under a multi-worker cluster (the handler then agrees on
            the step with its peers).
        save_fn: called with no argument on every worker at the agreed step.
        unused_dir: a directory path the handler's empty checkpoint manager is given.
    """

    def __init__(self, strategy, *, multi_worker, save_fn, unused_dir):
        resolver = strategy.cluster_resolver if multi_worker else None
        manager = tf.train.CheckpointManager(tf.train.Checkpoint(), directory=unused_dir, max_to_keep=1)
        config = tf.distribute.experimental.TerminationConfig(
            exit_fn=self._exit, save_fn=save_fn, grace_period=0
        )
        self._previous_handler = signal.getsignal(signal.SIGTERM)
        self._handler = tf.distribute.experimental.PreemptionCheckpointHandler(
            resolver, manager, termination_config=config
        )

    def _exit(self):
        signal.signal(signal.SIGTERM, self._previous_handler or signal.SIG_DFL)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(RESTART_EXIT_CODE)

    def step_done(self):
        """Call once per train step (execution) on every worker; may save and exit."""
        self._handler.save_checkpoint_if_preempted()

    def close(self):
        """Stops the handler's watcher threads and gives SIGTERM back its old handler."""
        handler, self._handler = self._handler, None
        if handler is None:
            return
        # The handler stops its threads only in __del__ (private methods, TF 2.12-2.21).
        handler._stop_poll_termination_signal_thread()
        handler._stop_cluster_wise_termination_watcher_thread()
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)
