"""The suite's own harness (tests/conftest.py): pytest exits as soon as it has reported."""

import os
import subprocess
import sys
import time

TESTS = os.path.dirname(os.path.abspath(__file__))
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
