"""Pipeline stages on other processes: a real 2-task cluster on loopback (issue 12).

Task 0 is the client (`connect_cluster`), task 1 serves its devices. Two shapes:
stages on different tasks, and a pipeline inside each task with data parallelism across
the tasks (2 x 2). Each is compared with the unsplit model trained in this process on one
device with the same global batch (losses rtol 1e-5, weights atol 1e-5).
"""

import signal
import time

import _hybrid_cluster_workers as workers
import numpy as np
import pytest
import tensorflow as tf

from tfscale.cluster import ClusterSpec
from tfscale.launch import run_local_cluster
from tfscale.strategies import PipelineStrategy, StrategyError, connect_cluster
from tfscale.strategies._peers import ClusterTimeoutError

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
RTOL, ATOL = 1e-5, 1e-5
TASK = "/job:worker/replica:0/task:{}/device:CPU:{}"


@pytest.fixture(scope="module")
def reference():
    with tf.device("/device:CPU:0"):
        model = workers.compile_(workers.model())
        history = workers.train(model)
    return history, model.get_weights()


def _run(shape, workdir=None):
    results = run_local_cluster(workers.pipeline, 2, args=(shape, "test", workdir), timeout=240, env=ENV)
    client, server = (r.value for r in results)
    assert server is None  # The serving task returned once the client had gone.
    return client


def _assert_like_reference(result, reference):
    history, weights = reference
    for key in ("loss", "mae"):
        np.testing.assert_allclose(result["history"][key], history[key], rtol=RTOL)
    assert len(result["weights"]) == len(weights)
    for got, want in zip(result["weights"], weights):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_stages_on_two_processes_train_like_one_device(reference, tmp_path):
    result = _run("stages", str(tmp_path))
    _assert_like_reference(result, reference)
    # Stage s: its variables and its momentum slots on task s.
    [stages] = result["placement"]
    for s, stage in enumerate(stages):
        assert stage == {"variables": [TASK.format(s, 0)], "slots": [TASK.format(s, 0)]}
    assert result["bytes_per_step"] > 0
    # Bad input, each one line naming the value: a task the cluster does not have, and
    # data_parallel x num_stages more than the cluster's 2 devices.
    assert "task worker:7 is not in the cluster" in result["bad_task"]
    assert "data_parallel=2 x num_stages=2 = 4 devices, more than the 2" in result["too_many"]
    assert "\n" not in result["bad_task"] + result["too_many"]
    # Backed up without gathering (issue 18): stage 2's variables and momentum slots, all that
    # lives on task 1, are one shard written on task 1 itself; the client's shards hold only
    # task 0's variables. A resume from the step-3 backup ends as the uninterrupted run.
    backup = result["backup"]
    on_task_1 = backup["on_task_1"]
    assert set(backup["stage_2"]) < set(on_task_1) and len(on_task_1) == 2 * len(backup["stage_2"])
    placed = [s for s in backup["shards"] if s["kind"] == "tensors"]
    assert [(s["device"], s["written_on"], sorted(s["names"])) for s in placed] == [
        (TASK.format(1, 0), TASK.format(1, 0), on_task_1)
    ]
    local = [s for s in backup["shards"] if s not in placed]
    assert local and all(
        "/task:1/" not in s["device"] and not set(s["names"]) & set(on_task_1) for s in local
    )
    assert backup["restored_step"] == 3
    for got, want in zip(backup["weights"], result["weights"], strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def hybrid():
    return _run("hybrid")


@pytest.mark.slow
def test_pipeline_in_each_process_data_parallel_across_them(reference, hybrid):
    result = hybrid
    _assert_like_reference(result, reference)
    # Written as on one host (no device names); replica d's two stages on task d's two CPUs.
    assert result["devices"] == ["/device:CPU:0", "/device:CPU:1", TASK.format(1, 0), TASK.format(1, 1)]
    for d, stages in enumerate(result["placement"]):
        for s, stage in enumerate(stages):
            assert stage == {"variables": [TASK.format(d, s)], "slots": [TASK.format(d, s)]}


def test_unreachable_task_fails_within_the_timeout_naming_it():
    # Nobody listens on worker 1's port: the client's bounded wait names it (TensorFlow's
    # connect would block in C++). Fails before any TensorFlow state changes here.
    from tfscale.launch import _procs

    ports = _procs.free_ports(2)
    cluster = ClusterSpec.from_hosts(workers=[f"127.0.0.1:{p}" for p in ports]).with_task("worker", 0)
    start = time.monotonic()
    with pytest.raises(
        ClusterTimeoutError, match=rf"worker:1 \(127.0.0.1:{ports[1]}\) never became reachable"
    ):
        connect_cluster(cluster, cluster_timeout=2)
    assert time.monotonic() - start < 10
    alone = ClusterSpec.from_hosts(workers=[f"127.0.0.1:{ports[0]}"]).with_task("worker", 0)
    with pytest.raises(StrategyError, match=r"`cluster`.*a cluster of 1 task\(s\)"):
        connect_cluster(alone)


@pytest.mark.slow
def test_killed_task_of_hybrid_job_resumes_from_backup(hybrid, tmp_path):
    # Attempt 1: after 3 of the 4 steps (mid-epoch 2) the client SIGKILLs task 1, which
    # serves copy 1's stages; the client's next step fails, and so does the attempt.
    failed = run_local_cluster(
        workers.resumable, 2, args=(str(tmp_path), 3), timeout=240, env=ENV, check=False
    )
    assert failed[1].returncode == -signal.SIGKILL
    assert failed[0].returncode != 0 and failed[0].value is None
    # Attempt 2: both tasks restarted (new ports); the backup resumes the step after the last one.
    resumed = run_local_cluster(workers.resumable, 2, args=(str(tmp_path),), timeout=240, env=ENV)[0].value
    assert len(resumed["history"]["loss"]) == 1  # Only epoch 2 ran again: a resume, not a rerun.
    for got, want in zip(resumed["weights"], hybrid["weights"]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # The hybrid model's weights file is the unsplit model's.
    unsplit = workers.model()
    unsplit.load_weights(resumed["path"])
    for got, want in zip(unsplit.get_weights(), resumed["weights"]):
        np.testing.assert_array_equal(got, want)


def test_a_stage_is_updated_on_its_own_device():
    # Across hosts, every tensor computed off a stage's device crosses the network. The
    # optimizer's update and its gradient all-reduce (Keras places both on the default
    # device), and the weight penalty's gradient, once moved 4x the remote stage's
    # parameter bytes per step. Here no op off CPU:1 may consume a weight-sized tensor
    # computed on CPU:1 (a read of a CPU:1 variable counts as on CPU:1).
    strategy = PipelineStrategy(
        num_stages=2, num_microbatches=2, devices=["/cpu:0", "/cpu:1"], balance="uniform"
    )
    pipelined = workers.compile_(strategy.split(workers.model((64, 64, 64))))
    x, y = workers.data(16)
    graph = tf.function(lambda a, b: pipelined.train_step((a, b))).get_concrete_function(x, y).graph
    # A variable read runs where the variable lives: the captured handle's device.
    handles_1 = {inner.op.name for outer, inner in graph.captures if outer.device.endswith("CPU:1")}
    on_1 = {
        op.name
        for op in graph.get_operations()
        if op.device.endswith("CPU:1") or (op.type == "ReadVariableOp" and op.inputs[0].op.name in handles_1)
    }
    crossing = [
        f"{op.name} <- {t.op.name}"
        for op in graph.get_operations()
        if op.name not in on_1
        for t in op.inputs
        if t.op.name in on_1 and (t.shape.num_elements() or 0) >= 64 * 64
    ]
    assert crossing == []
