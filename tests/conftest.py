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
  subprocesses or takes more than about 5 s, and keep a quick representative of its path
  in the fast tier (for a parametrized test: `FAST_REPRESENTATIVES` in its module, below);
  a `slow` mark on a test that is over that says which fast test stands for it
  (`tests/_tiers.py` lists those moved out by measurement, with their representatives).

Two workers (pytest-xdist, README's command `pytest -n 2`): the tests are single-threaded
enough that a 2-core machine runs two at once. A module's tests stay in one worker
(`xdist_group`, below; pytest < 9, see setup.cfg), so its module-scoped clusters and
reference runs are built once; a module whose tests share nothing expensive sets
`SPREAD_OVER_WORKERS = True` and its tests are dealt out one by one, to fill the tail of
the run (the equivalence cases). Every test
must hold on either worker: free ports picked at run time, files under its own tmp_path.

No garbage-collection settings and no early exit: an interrupted `fit`'s input (a tf.data
iterator, whose destructor can block up to a minute in TF 2.21) is freed by reference
counting, with tfscale's callbacks too (tfscale/compat/keras_fit_position.py breaks
Keras's own cycle, tfscale/compat/tf_platform_probe.py TensorFlow's), so pytest exits
within seconds of its summary. tests/test_conftest.py keeps such workarounds out.
"""

import json
import os

import _tiers
import pytest
from _launch_util import leftovers, new_marker

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


@pytest.fixture
def marker():
    """A fresh marker for the processes a test starts; it fails if one of them outlives the test."""
    value = new_marker()
    yield value
    assert leftovers(value) == [], "processes started by the test outlived it"


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects
def pytest_collection_modifyitems(config, items):
    """Keeps each module's tests on one xdist worker unless the module spreads them, and
    keeps the fast tier's representatives: a module's `FAST_REPRESENTATIVES` maps a
    parametrized test's name to how many of its cases (the first ones collected, not
    already slow) stay in the fast tier; the others are marked `slow` (full run only)."""
    kept = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if not getattr(module, "SPREAD_OVER_WORKERS", False):
            item.add_marker(pytest.mark.xdist_group(module.__name__))
        keep = getattr(module, "FAST_REPRESENTATIVES", {}).get(getattr(item, "originalname", None))
        if keep is None or item.get_closest_marker("slow") is not None:
            continue
        key = (module.__name__, item.originalname)
        kept[key] = kept.get(key, 0) + 1
        if kept[key] > keep:
            item.add_marker(pytest.mark.slow)
    for item in items:
        if item.nodeid in _tiers.FULL_RUN_ONLY:
            item.add_marker(pytest.mark.slow)
    report = os.environ.get("TFSCALE_TIERS_REPORT")  # tests/test_conftest.py reads the tiers
    if report:
        with open(report, "w", encoding="utf-8") as f:
            json.dump({i.nodeid: i.get_closest_marker("slow") is not None for i in items}, f)
