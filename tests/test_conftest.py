"""The suite's own rules: workarounds that hid product bugs stay out of tests/ and the profiler.

The 2-worker `tfscale-train` fixture retried a worker killed by the profiler, and the
profiler slept around its start and stop (now started and stopped in a deterministic
order, tfscale/compat/tf_barrier.py). (`tests/conftest.py`'s garbage-collection settings
and early exit are not banned yet: see its docstring.)
"""

import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PROFILER = ["tfscale/callbacks/communication_profiler.py", "tfscale/compat/tf_barrier.py"]

# Spelled in pieces so that this file does not match itself.
BANNED_IN_TESTS = {
    "retry on a crash": r"SIG" + r"SEGV|SIG" + r"ABRT|retry" + r"ing once",
}


def _python_files(folder):
    for parent, _, names in os.walk(folder):
        yield from (os.path.join(parent, n) for n in sorted(names) if n.endswith(".py"))


def _hits(paths, pattern):
    hits = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if re.search(pattern, line) and os.path.abspath(path) != os.path.abspath(__file__):
                    hits.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
    return hits


@pytest.mark.parametrize("rule", sorted(BANNED_IN_TESTS))
def test_no_workaround_in_tests(rule):
    assert _hits(_python_files(TESTS), BANNED_IN_TESTS[rule]) == []


def test_no_sleep_in_the_profiler():
    assert _hits([os.path.join(ROOT, p) for p in PROFILER], r"\bsle" + r"ep\(") == []


PYTEST = os.path.join(os.path.dirname(sys.executable), "pytest")

# A stand-in for the slow final clean-up (tf.data iterators destroyed by the last garbage
# collection, up to a minute each): anything that would still run at interpreter exit.
SLOW_EXIT = """
import atexit, time

def test_leaves_slow_work_for_exit():
    atexit.register(time.sleep, 120)

def test_fails():
    assert False
"""


def test_pytest_exits_after_its_summary_with_its_exit_status(tmp_path):
    (tmp_path / "test_slow_exit.py").write_text(SLOW_EXIT)
    start = time.monotonic()
    run = subprocess.run(
        [PYTEST, "-p", "conftest", "-p", "no:cacheprovider", "-q", str(tmp_path / "test_slow_exit.py")],
        env=dict(os.environ, PYTHONPATH=TESTS),  # tests/conftest.py as a plugin, for a file outside tests/
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "1 failed, 1 passed" in run.stdout
    assert time.monotonic() - start < 60  # TensorFlow's import (the conftest splits the CPU) and the run
