"""tfscale.launch.run_local_cluster: real processes, TF_CONFIG per task, no orphans."""

import sys
import time

import _cluster_helper_targets as targets
import pytest
from _launch_util import MARKER

from tfscale.launch import ClusterRunError, LaunchError, run_local_cluster


def test_each_task_gets_its_own_tf_config_of_one_cluster(marker):
    results = run_local_cluster(targets.report_task, 3, chief=True, env={MARKER: marker}, timeout=60)
    assert [(r.task_type, r.index) for r in results] == [
        ("chief", 0),
        ("worker", 0),
        ("worker", 1),
        ("worker", 2),
    ]
    configs = [r.value["config"] for r in results]
    assert all(c["cluster"] == configs[0]["cluster"] for c in configs)
    assert [c["task"] for c in configs] == [
        {"type": t, "index": i} for t, i in [("chief", 0), ("worker", 0), ("worker", 1), ("worker", 2)]
    ]
    addresses = configs[0]["cluster"]["chief"] + configs[0]["cluster"]["worker"]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    assert all(r.value["environ"][MARKER] == marker for r in results)  # the caller's environment is passed on


def test_timeout_kills_every_task_and_its_children(marker):
    start = time.monotonic()
    with pytest.raises(ClusterRunError, match="timed out after 3s") as raised:
        run_local_cluster(targets.hang_with_grandchild, 2, env={MARKER: marker}, timeout=3)
    assert time.monotonic() - start < 20
    assert all(r.returncode < 0 for r in raised.value.results)  # ended by a signal


def test_a_failed_task_stops_its_hanging_peers_and_reports_its_traceback(marker):
    start = time.monotonic()
    with pytest.raises(ClusterRunError, match="worker one gives up") as raised:
        run_local_cluster(targets.fail_on_worker_one, 2, env={MARKER: marker}, timeout=120, failure_grace=1)
    assert time.monotonic() - start < 30  # not the 120 s timeout
    worker0, worker1 = raised.value.results
    assert worker1.returncode == 1 and worker0.returncode < 0


def test_command_targets_run_as_given(marker, tmp_path):
    script = tmp_path / "task.py"
    script.write_text(
        "import json, os; print('task', json.loads(os.environ['TF_CONFIG'])['task']['index'])\n"
    )
    results = run_local_cluster([sys.executable, str(script)], 2, env={MARKER: marker}, timeout=60)
    assert [r.log.strip() for r in results] == ["task 0", "task 1"]


def test_closures_are_rejected_with_a_clear_error():
    def local_function():
        return 1

    with pytest.raises(LaunchError, match="Expected a module-level function"):
        run_local_cluster(local_function, 1)
