"""When `BackupAndRestore` backs up: the save cadence as a policy, free of TensorFlow.

Three cadences, as Keras's `_should_save_on_batch` and Orbit's checkpoint interval keep
theirs in one place:

- `"epoch"`: at each epoch end.
- an integer N: at the step that crosses a multiple of N.
- an integer N with `async_save` ("bounded"): never more than N steps at risk. A kill
  loses the steps since the newest *published* backup, and a write takes time, so a
  snapshot is taken `lag` steps before the published one would be N old, `lag` being
  about twice the steps a write has been taking (at most N // 2, so at most one write is
  in flight); the caller waits for the write in flight only if the next steps would
  otherwise leave more than N steps after the newest published backup. When to snapshot
  depends only on steps and the lag the workers agreed on, so every worker snapshots at
  the same step.

The callback tells the policy what happened (`start`, `steps_done`, `scheduled`,
`published`) and asks it what to do (`due`, `lag`, `must_wait`, `at_epoch_end`).
"""

import math

__all__ = ["SavePolicy"]


class SavePolicy:
    """The save cadence of one `BackupAndRestore` (see the module docstring)."""

    def __init__(self, save_freq, async_save):
        self.save_freq = save_freq
        self.bounded = bool(async_save) and type(save_freq) is int
        self.start(0)

    def start(self, global_step):
        """At `fit`'s start, after any restore: `global_step` is the newest backup's (or 0)."""
        self.published_step = global_step
        self.write_seconds = self.step_seconds = None
        self._timed = 0
        self.next_due = global_step + self.save_freq - self.lag() if self.bounded else None

    def at_epoch_end(self):
        """Whether an epoch's end backs up."""
        return self.save_freq == "epoch"

    def steps_done(self, seconds_per_step):
        """Records one `on_train_batch_end` (bounded only): the step time, the first left out."""
        self._timed += 1
        if self._timed > 1:  # the first execution of a `fit` also traces the step
            old = self.step_seconds
            self.step_seconds = seconds_per_step if old is None else 0.8 * old + 0.2 * seconds_per_step
        return self

    def due(self, before, step, done, last_saved):
        """Whether to back up at `step` (global), reached from `before` in `done` steps."""
        freq = self.save_freq
        if type(freq) is not int:
            return False
        if not self.bounded:
            return step // freq > before // freq
        last = last_saved if last_saved is not None else self.published_step
        return step >= self.next_due or step + done - last > freq

    def scheduled(self, step, done, lag):
        """After a bounded backup at `step` with the agreed `lag`: when the next one is due."""
        self.next_due = step + max(done, self.save_freq - lag)

    def must_wait(self, step, done):
        """Whether the write in flight must end first (bounded): else more than N steps at risk."""
        return self.bounded and step + done - self.published_step > self.save_freq

    def published(self, step, write_seconds):
        """A backup of `step` is on disk; its write took `write_seconds` (the writer's thread)."""
        self.published_step = step
        self.write_seconds = write_seconds

    def lag(self):
        """Steps between a snapshot and the step its write must be published by."""
        most = self.save_freq // 2
        if self.write_seconds is None or not self.step_seconds:
            return most  # no write measured yet (the first one is often the slowest)
        steps = math.ceil(self.write_seconds / self.step_seconds)  # steps one write takes
        if steps >= self.save_freq:
            # It cannot overlap enough to pay for the extra backups an early snapshot
            # makes: snapshot every save_freq steps and wait for each write at once.
            return 0
        return min(most, 2 * steps + 1)
