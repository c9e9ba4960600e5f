"""Shared test setup: one TensorFlow runtime per pytest process, split into 4 logical CPUs.

TensorFlow fixes its logical devices when its runtime starts, so the split happens here,
before any test touches TensorFlow. In-process tests use the first N of these 4 devices
(`cpu_replicas=N`, pipeline stages, model-split devices); multi-worker tests run in
subprocesses started by `tfscale.launch.run_local_cluster`.
"""

import atexit
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
