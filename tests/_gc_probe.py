"""A pytest plugin that logs slow garbage collections and slow tests, per xdist worker.

    PYTHONPATH=tests .venv/bin/pytest -n 2 -p _gc_probe      (logs in $TFSCALE_GC_PROBE_DIR or /tmp)

Writes `gc_<worker>.txt`: every collection over 0.3 s (generation, seconds, objects freed,
the test that was running), the heap size every 100 tests, and every test call over 8 s.
Not loaded by the suite; a diagnostic for issue 28.

What it found (2026-12-05, main at e57b5f8, `pytest -n 2` on 2 cores): by 40% of a full
run, 127 gen-2 collections of 0.3 s or more, 538 s in all over both workers, single ones
up to 77 s, while the heap stayed at 0.45-0.55 M objects: the time is in destructors of
what the collection frees, not in the traversal. Tests alone take a fraction of what they
take in a run (test_compat coexist 3.7 s alone / 48 s in CI, a backup test 0.95 / 41 s,
a 0.12 s one 18 s). On tests/test_backup_and_restore.py + test_hostile_backup.py (not slow,
one process): 7 collections, 62 s of a 139 s run. The garbage is `fit`s that raised: the
test's `pytest.raises` frame holds the exception, whose traceback holds `fit`'s frames
(a cycle), and plain Keras's own cycle (EpochIterator._epoch_iterator, see
tests/test_compat_backup.py) holds the interrupted input. Freeing them early instead
(`traceback.clear_frames` at the end of each `pytest.raises` block) tore a live
MultiDeviceIterator down mid-epoch and crashed (SEGV at once, the race of
tfscale/compat/keras_symbolic_build.py); parking the iterator and collecting the rest
still cost 0.2-0.5 s a collection (traced functions of the dead model). Not yet fixed.
"""

import gc
import os
import threading
import time

_state = {"test": None, "start": None, "count": 0, "file": None}


def _log(message):
    if _state["file"] is None:
        directory = os.environ.get("TFSCALE_GC_PROBE_DIR", "/tmp")
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _state["file"] = open(os.path.join(directory, f"gc_{worker}.txt"), "a")  # open for the process's life
    _state["file"].write(message + "\n")
    _state["file"].flush()


def _on_collection(phase, info):
    if phase == "start":
        _state["start"] = time.perf_counter()
    elif _state["start"] is not None:
        seconds = time.perf_counter() - _state["start"]
        if seconds > 0.3:
            freed, test = info["collected"], _state["test"]
            _log(f"GC gen{info['generation']} {seconds:.2f}s collected={freed} test={test}")


gc.callbacks.append(_on_collection)


def pytest_runtest_setup(item):
    _state["test"] = item.nodeid
    _state["count"] += 1
    if _state["count"] % 100 == 0:
        _log(
            f"OBJ {len(gc.get_objects())} threads={threading.active_count()} "
            f"tasks={len(os.listdir('/proc/self/task'))} at test #{_state['count']} {item.nodeid}"
        )


def pytest_runtest_logreport(report):
    if report.when == "call" and report.duration > 8:
        _log(f"SLOW {report.duration:.1f}s {report.nodeid}")
