"""BackupAndRestore's save cadence (tfscale/_save_policy.py), without TensorFlow.

The policy is driven here by a simulated training loop and a simulated background writer
whose write takes a set number of steps; `BackupAndRestore` drives it the same way from its
hooks (tests/test_backup_async.py runs it for real).
"""

import subprocess
import sys

import pytest

from tfscale._save_policy import SavePolicy


def test_the_policy_module_imports_no_tensorflow():
    code = (
        "import sys, tfscale._save_policy\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorflow', 'keras')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_epoch_cadence_saves_at_epoch_ends_only():
    policy = SavePolicy("epoch", async_save=True)
    assert policy.at_epoch_end() and not policy.bounded
    assert not any(policy.due(s, s + 1, 1, None) for s in range(100))
    assert not SavePolicy(7, async_save=False).at_epoch_end()
    assert not SavePolicy(False, async_save=False).due(0, 100, 100, None)


@pytest.mark.parametrize("done", [1, 3, 4, 10])
def test_every_n_steps_saves_where_a_multiple_is_crossed(done):
    # `done` steps per `on_train_batch_end` (steps_per_execution): one save per multiple crossed.
    policy = SavePolicy(4, async_save=False)
    steps = range(done, 41, done)
    saved = [step for step in steps if policy.due(step - done, step, done, None)]
    # at the first batch end at or after each multiple of 4, once
    assert saved == sorted({min(s for s in steps if s >= m) for m in range(4, steps[-1] + 1, 4)})


def _simulate(freq, write_steps, steps=400, done=1):
    """Runs the bounded policy as BackupAndRestore does, with writes that take `write_steps`
    steps each (one in flight at most); returns (snapshot steps, writer waits, most at risk)."""
    policy = SavePolicy(freq, async_save=True)
    policy.start(0)
    in_flight = None  # (snapshot step, step by which it is published)
    last_saved, snapshots, waits, most_at_risk = None, [], 0, 0

    def publish():
        policy.published(in_flight[0], write_steps * 1.0)  # 1 s per step

    for step in range(done, steps + 1, done):
        if in_flight is not None and step >= in_flight[1]:
            publish()
            in_flight = None
        policy.steps_done(1.0)
        if policy.due(step - done, step, done, last_saved):
            lag = policy.lag()
            if in_flight is not None:  # `_save` waits for the previous write first
                publish()
                in_flight, waits = None, waits + 1
            in_flight, last_saved = (step, step + write_steps), step
            snapshots.append(step)
            policy.scheduled(step, done, lag)
        if policy.must_wait(step, done) and in_flight is not None:
            publish()
            in_flight, waits = None, waits + 1
        most_at_risk = max(most_at_risk, step + done - policy.published_step)
    return snapshots, waits, most_at_risk


@pytest.mark.parametrize("write_steps", [1, 2, 3, 5])
@pytest.mark.parametrize("done", [1, 2])
def test_bounded_async_never_risks_more_than_n_steps_and_overlaps_short_writes(write_steps, done):
    snapshots, waits, most_at_risk = _simulate(20, write_steps, done=done)
    assert most_at_risk <= 20
    # Writes shorter than the lag overlap training: no wait after the first measured write.
    assert waits <= 1
    # Snapshots come a lag early (about twice a write's steps), not at multiples of 20.
    gaps = {b - a for a, b in zip(snapshots[2:], snapshots[3:])}
    lag = min(10, 2 * write_steps + 1)
    assert gaps == {-(-(20 - lag) // done) * done}  # the first batch end at or past the due step


def test_bounded_async_with_writes_longer_than_n_steps_waits_for_each():
    # A write that takes 25 steps cannot overlap: snapshot every 20 steps and wait each time.
    snapshots, waits, most_at_risk = _simulate(20, 25)
    assert most_at_risk <= 20
    assert snapshots[2:12] == list(range(snapshots[2], snapshots[2] + 200, 20))
    assert waits >= len(snapshots) - 2


def test_the_first_fit_step_is_not_timed_and_the_lag_starts_at_half_n():
    policy = SavePolicy(10, async_save=True)
    policy.start(100)  # resumed from a backup of step 100
    assert policy.lag() == 5 and policy.next_due == 105 and policy.published_step == 100
    policy.steps_done(50.0)  # the first execution also traces: left out
    assert policy.step_seconds is None
    policy.steps_done(1.0).steps_done(2.0)
    assert policy.step_seconds == pytest.approx(0.8 * 1.0 + 0.2 * 2.0)
    policy.published(104, 1.2)  # a write of ~1 step: lag 2*1+1
    assert policy.lag() == 3
