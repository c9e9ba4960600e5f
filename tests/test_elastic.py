"""Elastic `tfscale-launch --num_workers MIN:MAX`: shrink on a lost worker, grow when it is back.

The semantics tests run the real launcher on a cheap task (`_elastic_task.py`);
one slow test runs real 3-worker `tfscale-train` jobs and checks that a job that
lost a worker and got it back ends at the weights of an uninterrupted run. A
discovery command (`cat FILE`) tells the launcher which slots are usable; the
tests edit FILE. No process the launcher started may be left (`leftovers`).
"""

import json
import os
import sys
import time

import pytest
from _launch_util import leftovers, new_marker, run_launcher, start_launcher

from tfscale.launch import _discovery, elastic
from tfscale.launch.supervisor import LaunchError

HERE = os.path.dirname(os.path.abspath(__file__))
TASK = os.path.join(HERE, "_elastic_task.py")
TRAIN = os.path.join(os.path.dirname(sys.executable), "tfscale-train")
ELASTIC = ["--discovery_interval", "0.3", "--restart_backoff", "0.2", "--grace_period", "5"]


@pytest.fixture
def marker():
    value = new_marker()
    yield value
    assert leftovers(value) == [], "processes started by the launcher outlived it"


def _discovery_file(tmp_path, slots):
    path = tmp_path / "usable"
    path.write_text(f"localhost:{slots}\n")
    return path


def _read_until(proc, needle, seen, timeout=300):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not seen; output ends with:\n{''.join(seen[-60:])}")


def _finish(proc, seen, timeout=300):
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    seen.append(out)
    return "".join(seen)


def test_fewer_than_min_usable_workers_waits_then_fails_in_one_line(marker, tmp_path):
    usable = _discovery_file(tmp_path, 1)
    start = time.monotonic()
    run = run_launcher(
        ["--num_workers", "2:3", "--host_discovery", f"cat {usable}", "--elastic_timeout", "1.5",
         *ELASTIC, "--", sys.executable, TASK, "unused"],
        marker,
    )  # fmt: skip
    assert time.monotonic() - start >= 1.5
    assert run.returncode == 1
    assert run.stdout == ""  # no task was started
    assert run.stderr.splitlines()[-1] == (
        "tfscale-launch: job failed: 1 usable worker slot, --num_workers 2:3 needs at least 2 "
        "(waited 1.5s, --elastic_timeout)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num_workers", "2:3", "--", TRAIN], "`--global_batch_size=64` is not divisible by 3 replicas"),
        (
            ["--num_workers", "1:4", "--", TRAIN, "--global_batch_size", "36", "--cpu_replicas=2"],
            "`--global_batch_size=36` is not divisible by 8 replicas, a size `--num_workers 1:4` allows. "
            "Expected a multiple of 24",
        ),
        (["--num_workers", "3:2", "--", "true"], "Received: '3:2'. Expected a positive integer N or MIN:MAX"),
        (["--num_workers", "2:3", "--chief", "--", "true"], "runs workers only"),
        (["--num_workers", "2:3", "--", TRAIN, "--per_replica_batch_size=8"], "fixes `--per_replica_batch"),
    ],
)
def test_bad_elastic_flags_are_one_line_and_exit_2(marker, args, message):
    run = run_launcher(args, marker)
    assert run.returncode == 2, run.stderr
    assert run.stdout == ""
    (line,) = run.stderr.splitlines()
    assert message in line


def test_job_shrinks_when_a_worker_is_lost_and_grows_when_its_slot_is_back(marker, tmp_path):
    usable, go = _discovery_file(tmp_path, 3), tmp_path / "go"
    args = ["--num_workers", "2:3", "--host_discovery", f"cat {usable}", "--max_restarts", "1", *ELASTIC,
            "--", sys.executable, TASK, str(go)]  # fmt: skip
    proc = start_launcher(args, marker, merge_stderr=True)
    seen = []
    _read_until(proc, "[worker:2] size 3 index 2 restart 0", seen)
    usable.write_text("localhost:2\n")
    go.touch()  # worker 2 fails; its slot is no longer listed
    _read_until(proc, "[worker:1] size 2 index 1 restart 1", seen)
    usable.write_text("# the slot is back\nlocalhost:3\n")
    assert proc.wait(timeout=60) == 0
    output = _finish(proc, seen)
    assert "elastic: running at 3 workers (start) on localhost:3" in output
    assert (
        "elastic: running from 3 to 2 workers (worker:2 failed (exit code 1) in attempt 1) on localhost:2"
        in output
    )
    assert "restarting the job on the usable slots (restart 1 of 1)" in output
    # Growing is not a failure: it needs no restart left, and the tasks back up first.
    assert "elastic: 3 usable worker slots, the job ran on 2: asking every task to back up" in output
    assert "elastic: tasks stopped for the resize (worker:0 exit code 75, worker:1 exit code 75)" in output
    assert output.count("[worker:0] backed up") == 2  # stopped after the failure, and for the grow
    assert "elastic: running from 2 to 3 workers (3 usable worker slots, the job ran on 2)" in output
    configs = [
        json.loads(line.split("TF_CONFIG=", 1)[1]) for line in output.splitlines() if "TF_CONFIG=" in line
    ]
    assert [len(c["cluster"]["worker"]) for c in configs] == [3, 3, 3, 2, 2, 3, 3, 3]
    assert "[worker:2] size 3 index 2 restart 2" in output
    assert "job succeeded in attempt 3 on 3 workers" in output


def test_discovery_lines_and_host_cooldown():
    assert _discovery.parse_hosts("# usable\nnode1:4\n\nnode2\n", "x") == [("node1", 4), ("node2", 1)]
    with pytest.raises(LaunchError, match=r"Received: 'node1:four'. Expected `host` or `host:slots`"):
        _discovery.parse_hosts("node1:four", "`--host_discovery`")
    now = [0.0]
    cooldown = _discovery.Cooldown(60, clock=lambda: now[0])
    hosts = [("a", 2), ("b", 2)]
    assert not cooldown.failed("a")  # one failure: may be the process, not the host
    cooldown.succeeded(["a"])
    assert not cooldown.failed("a")
    assert cooldown.failed("a")  # twice in a row: left out
    assert cooldown.usable(hosts) == [("b", 2)]
    now[0] = 61.0
    assert cooldown.usable(hosts) == hosts
    assert elastic._choose([("a", 2), ("b", 2), ("c", 1)], 3) == [("a", 2), ("b", 1)]
