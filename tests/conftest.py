"""Shared test setup: one TensorFlow runtime per pytest process, split into 4 logical CPUs.

TensorFlow fixes its logical devices when its runtime starts, so the split happens here,
before any test touches TensorFlow. In-process tests use the first N of these 4 devices
(`cpu_replicas=N`, pipeline stages, model-split devices); multi-worker tests run in
subprocesses started by `tfscale.launch.run_local_cluster`.

Tiers (the `slow` marker, pyproject.toml):
- fast, `pytest -m "not slow"`: what a developer runs after every change (target: under
  5 minutes on a quiet 2-core machine). Every module's main path, in process where it can
  be, with one representative of each multi-process path (a 2-worker cluster, a launcher
  restart, a kill-and-resume).
- full, `pytest` (README's command; `.ci/run` runs it): the fast tier plus every test
  marked `slow` -- more clusters, more kill points, the launcher and elastic variants,
  the hostile and chaos cases. Mark a new test `slow` when it starts TensorFlow
  subprocesses or takes more than a few seconds, and keep a quick representative of it
  in the fast tier.

The garbage-collection settings and the early exit below stay for now: tfscale frees an
interrupted `fit`'s input by reference counting (tfscale/compat/keras_fit_position.py),
but without them a 2-file subset (test_backup_and_restore.py + test_compat_backup.py,
fast tier) still sat 70 s between its summary and its exit (load 11): other cycles hold
tf.data iterators in this process, not yet found.
"""

import atexit
import gc
import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfscale.strategies

NUM_TEST_CPUS = 4
tfscale.strategies.split_cpu(NUM_TEST_CPUS)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """The bundled digits dataset, prepared once for every test that reads it (`data_dir=`).

    A module that needs another dataset there defines its own `data_dir`.
    """
    from tfscale.datasets import digits

    path = str(tmp_path_factory.mktemp("tfds"))
    digits.prepare(path)
    return path


# No full (generation 2) garbage collection during the session. A full collection is what
# destroys the tf.data iterators that interrupted `fit`s leave in reference cycles (below),
# and each one then blocks for as long as its autotuning thread's wait has grown, up to a
# minute: measured, tests/test_backup_and_restore.py + test_cluster_fuzz.py took 258 s with
# the default thresholds and 165 s with this one (peak RSS 0.95 vs 1.18 GB). Young cycles
# are still collected; the long-lived garbage is left to the process's end, skipped below.
gc.set_threshold(*gc.get_threshold()[:2], 10**6)


def pytest_configure(config):
    # pytest's unraisable-exception plugin collects garbage once more at the end (3 minutes
    # here, destroying all those iterators at once); it has a setting for how many times.
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # another pytest: its end-of-session collection, if any, stays
        return
    config.stash[gc_collect_iterations_key] = 0


# Without this, pytest prints its summary and then sits silent for 1-3 minutes: tests that
# interrupt `fit` (injected faults, SIGTERM) leave tf.data iterators alive in reference
# cycles (a caught exception's traceback keeps `fit`'s frames), and destroying such an
# iterator blocks in `~RootDataset::Iterator` until its autotuning thread's
# `Model::OptimizeLoop` wakes from a timed wait of up to a minute (TF 2.21; the cancellation
# does not wake it). The final garbage collection destroys them one after another. Nothing
# is left to do once pytest has returned its exit status, so the process ends right there.
_SESSION = pytest.StashKey()


def pytest_sessionfinish(session):
    session.config.stash[_SESSION] = session


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # Only the `pytest` command: a program that calls pytest.main() keeps its own exit.
    session = config.stash.get(_SESSION, None)
    if session is not None and os.path.basename(sys.argv[0]) in ("pytest", "py.test"):
        # Registered last, so it runs first at exit, after pytest's own clean-up.
        atexit.register(_exit_now, int(session.exitstatus))


def _exit_now(status):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
