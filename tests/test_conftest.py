"""The suite's own rules: workarounds that hid product bugs stay out of tests/ and the profiler.

The 2-worker `tfscale-train` fixture retried a worker killed by the profiler, and the
profiler slept around its start and stop (now started and stopped in a deterministic
order, tfscale/compat/tf_barrier.py). `tests/conftest.py` turned garbage collection
off and ended pytest with an early exit, because interrupted `fit`s left tf.data iterators
in reference cycles; those cycles are broken at their source now (see its docstring).
"""

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
PROFILER = ["tfscale/callbacks/communication_profiler.py", "tfscale/compat/tf_barrier.py"]

# Spelled in pieces so that this file does not match itself.
BANNED_IN_TESTS = {
    "retry on a crash": r"SIG" + r"SEGV|SIG" + r"ABRT|retry" + r"ing once",
    "early exit": r"os\._" + r"exit\(",
    "garbage collection settings": r"gc\.(set_" + r"threshold|dis" + r"able|fre" + r"eze)\(",
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


_DYING_WORKER = """
import os, time, pytest

@pytest.mark.xdist_group("dies")
@pytest.mark.parametrize("i", range(6))
def test_dies(i):
    time.sleep(0.3)
    if i == 2:
        os.abort()  # a worker killed by a signal, as TensorFlow's crashes kill it

@pytest.mark.xdist_group("lives")
@pytest.mark.parametrize("i", range(6))
def test_lives(i):
    time.sleep(0.5)
"""


def test_a_worker_that_dies_fails_the_run_at_once(tmp_path):
    """README's `pytest -n 2` with this project's options: a dead worker ends the run, red, naming
    the test. (pytest-xdist's default restarts it, and under loadgroup that run never ended.)"""
    (tmp_path / "test_dying.py").write_text(_DYING_WORKER)
    command = [sys.executable, "-m", "pytest", "-c", os.path.join(ROOT, "pyproject.toml"),
               "--rootdir", str(tmp_path), "-n", "2", "-p", "no:cacheprovider", str(tmp_path)]  # fmt: skip
    try:
        run = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("a run with a dead worker did not end within 120 s")
    assert run.returncode == 1, run.stdout[-2000:]
    assert "crashed while running 'test_dying.py::test_dies[2]" in run.stdout, run.stdout[-2000:]


def _collected(*args):
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return [line for line in out.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # 12 s, two collections
def test_fast_representatives_keep_the_first_n_cases_in_the_fast_tier_and_all_in_the_full_run():
    # tests/test_zero.py keeps the first case of its optimizer-option comparison in the fast tier.
    name = "tests/test_zero.py::test_zero_trains_to_one_device_and_stage_0_weights"
    everything = [t for t in _collected("tests/test_zero.py") if t.startswith(name + "[")]
    fast = [t for t in _collected("tests/test_zero.py", "-m", "not slow") if t.startswith(name + "[")]
    assert len(fast) == 1 and fast == everything[:1] and len(everything) > 1  # the rest: slow


@pytest.mark.slow  # a real 2-worker run of two modules (each worker starts TensorFlow)
def test_each_module_runs_on_one_worker_unless_it_spreads_its_tests():
    """conftest's `xdist_group` marks reach xdist: each module's tests run on one worker.

    Seen broken under pytest 9 (setup.cfg pins pytest < 9): xdist 3.8 writes the group
    into a field pytest 9 no longer reads, and every module was dealt out test by test."""
    modules = ["tests/test_layers.py", "tests/test_save_policy.py"]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "-v", "-p", "no:cacheprovider", *modules],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    workers = {}
    for line in run.stdout.splitlines():
        found = re.match(r"\[(gw\d)\] .*PASSED (tests/\w+\.py)::", line)
        if found:
            workers.setdefault(found.group(2), set()).add(found.group(1))
    assert sorted(workers) == modules, run.stdout[-2000:]
    assert all(len(seen) == 1 for seen in workers.values()), workers


@pytest.mark.slow  # collects the whole suite (about 10 s); test_no_workaround_in_tests is fast
def test_tests_moved_out_of_the_fast_tier_name_fast_representatives(tmp_path):
    """Every entry of tests/_tiers.py names a collected test, now slow, and a collected test
    that stays in the fast tier: a renamed test cannot leave its path uncovered unnoticed."""
    import _tiers

    report = tmp_path / "tiers.json"
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", TESTS],
        check=False,
        cwd=ROOT,
        env={**os.environ, "TFSCALE_TIERS_REPORT": str(report)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    slow = json.loads(report.read_text())
    assert len(slow) > 1000
    problems = [f"not collected: {t}" for t in _tiers.FULL_RUN_ONLY if t not in slow]
    problems += [f"not slow: {t}" for t in _tiers.FULL_RUN_ONLY if slow.get(t) is False]
    fast = {r for r in _tiers.FULL_RUN_ONLY.values() if slow.get(r) is False}
    problems += [f"representative not fast: {r}" for r in set(_tiers.FULL_RUN_ONLY.values()) - fast]
    assert problems == []
