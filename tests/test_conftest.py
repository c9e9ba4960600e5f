"""The suite's own rules: workarounds that hid product bugs stay out of tests/ and the profiler.

The 2-worker `tfscale-train` fixture retried a worker killed by the profiler, and the
profiler slept around its start and stop (now started and stopped in a deterministic
order, tfscale/compat/tf_barrier.py). `tests/conftest.py` turned garbage collection
off and ended pytest with an early exit, because interrupted `fit`s left tf.data iterators
in reference cycles; those cycles are broken at their source now (see its docstring).
"""

import os
import re

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
