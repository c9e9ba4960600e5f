"""No hang on missing peers: the wait for a cluster's peers is bounded and SIGTERM ends it.

Real sockets and real processes: a TF_CONFIG naming a worker that never starts.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from tfscale.cluster import ClusterSpec
from tfscale.launch import _procs
from tfscale.strategies import StrategyError, get
from tfscale.strategies._peers import ClusterTimeoutError, wait_for_peers


def _cluster(task_index=0):
    ports = _procs.free_ports(2)
    return ClusterSpec({"worker": [f"localhost:{p}" for p in ports]}, "worker", task_index)


def test_missing_peer_fails_within_cluster_timeout_naming_it():
    cluster = _cluster()
    start = time.monotonic()
    with pytest.raises(ClusterTimeoutError, match=r"worker:1 \(localhost:\d+\) never started"):
        get("multi_worker", cluster=cluster, cluster_timeout=1.5)
    assert 1.5 <= time.monotonic() - start < 10
    assert ClusterTimeoutError.exit_status == 1  # A failed run, not bad input.


def test_peers_that_all_probe_first_find_each_other_then_bind_their_ports():
    # Each worker listens while it probes, so two workers waiting for each other both return;
    # then each binds its own port as TensorFlow's server does (a probe listener left behind,
    # e.g. closed while its thread sat in accept(), would make that bind fail).
    ports = _procs.free_ports(2)
    spec = {"worker": [f"localhost:{p}" for p in ports]}
    errors, servers, stop = [], [], threading.Event()

    def worker(index):
        try:
            wait_for_peers(ClusterSpec(spec, "worker", index), 20)
            with socket.socket() as server:
                server.bind(("", ports[index]))
                server.listen(8)
                servers.append(index)
                stop.wait(30)  # serving, as TensorFlow would, until the test ends
        except Exception as e:  # Reported below, in the test's thread.
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len(servers) + len(errors) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors and sorted(servers) == [0, 1]


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), "5", True, None])
def test_cluster_timeout_must_be_positive_finite_seconds(value):
    with pytest.raises(StrategyError, match=r"`cluster_timeout`. Received: cluster_timeout="):
        get("multi_worker", cluster=_cluster(), cluster_timeout=value)


def _train(cluster, *flags):
    env = dict(os.environ, TF_CONFIG=json.dumps(cluster.to_tf_config()), TF_CPP_MIN_LOG_LEVEL="2")
    cmd = [sys.executable, "-m", "tfscale.train", "--epochs=1", "--steps_per_epoch=2", *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_train_with_a_peer_that_never_starts_exits_1_naming_it():
    proc = _train(_cluster(), "--cluster_timeout=3")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tfscale-train: error: Task worker:0 waited"), err
    assert "worker:1 (localhost:" in lines[0]


@pytest.mark.slow
def test_sigterm_ends_train_while_it_waits_for_peers():
    proc = _train(_cluster(), "--cluster_timeout=600")
    for line in proc.stdout:  # Waiting starts right after the strategy choice is logged.
        if "multi_worker" in line:
            break
    time.sleep(2)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM
