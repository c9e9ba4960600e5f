"""ClusterSpec: every source, every validation error, and agreement with TensorFlow's own resolvers."""

import json
import os
import pickle
from unittest import mock

import _cluster_workers as workers
import numpy as np
import pytest
import tensorflow as tf

import tfscale.strategies
from tfscale.cluster import ClusterSpec, ClusterSpecError
from tfscale.launch import _procs, run_local_cluster

W3 = {"worker": ["a:2222", "b:2222", "c:2222"]}


# --- construction and the TF_CONFIG round trip -------------------------------------------------


def test_cluster_is_normalized_to_tf_order_and_read_only():
    spec = ClusterSpec({"evaluator": ["e:1"], "worker": ["w:1", "w:2"], "chief": ["c:1"], "ps": []})
    assert list(spec.cluster) == ["chief", "worker", "evaluator"]
    assert spec.cluster["worker"] == ("w:1", "w:2")
    assert spec.task_count == 4 and spec.num_workers == 3
    assert spec.tasks() == [
        ("chief", 0, "c:1"),
        ("worker", 0, "w:1"),
        ("worker", 1, "w:2"),
        ("evaluator", 0, "e:1"),
    ]
    with pytest.raises(TypeError, match="read-only"):
        spec.cluster["ps"] = ("p:1",)
    assert pickle.loads(pickle.dumps(spec.with_task("worker", 1))) == spec.with_task("worker", 1)
    assert len({spec, ClusterSpec(dict(spec.cluster))}) == 1


def test_to_tf_config_of_own_task_other_task_and_no_task():
    spec = ClusterSpec.from_tf_config({"cluster": W3, "task": {"type": "worker", "index": 2}})
    assert spec.to_tf_config() == {"cluster": W3, "task": {"type": "worker", "index": 2}}
    assert json.loads(spec.to_json("worker", 0))["task"] == {"type": "worker", "index": 0}
    assert ClusterSpec(W3).to_tf_config() == {"cluster": W3}
    assert spec.task_address() == "c:2222" and spec.task_address("worker", 0) == "a:2222"


def test_from_env_reads_tf_config_and_allows_no_task():
    with mock.patch.dict(os.environ, {"TF_CONFIG": json.dumps({"cluster": W3})}):
        spec = ClusterSpec.from_env()
    assert spec.task_type is None and spec.cluster["worker"] == tuple(W3["worker"])
    with pytest.raises(ClusterSpecError, match="`TF_CONFIG` is not set"):
        ClusterSpec.from_env(environ={})


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("{not json", r"not JSON \(Expecting property name"),
        ("[1, 2]", r"Expected a JSON object"),
        ({"clusters": W3}, r"Invalid key in TF_CONFIG. Received: 'clusters'"),
        ({"task": {"type": "worker", "index": 0}}, r"Missing `cluster`"),
        (
            {"cluster": {"wroker": ["a:1"]}},
            r"Invalid task type `cluster.wroker`.*Expected one of chief, worker",
        ),
        ({"cluster": {"worker": "a:1"}}, r"`cluster.worker`.*Expected a list"),
        ({"cluster": {"worker": ["a:1", "b:2", "c"]}}, r"`cluster.worker\[2\]`. Received: 'c'"),
        ({"cluster": {"worker": ["a:1", "b:2", 7]}}, r"`cluster.worker\[2\]`. Received: 7"),
        ({"cluster": {"worker": ["a:0"]}}, r"Invalid port in `cluster.worker\[0\]`"),
        ({"cluster": {"worker": ["a:70000"]}}, r"Invalid port in `cluster.worker\[0\]`.*1-65535"),
        ({"cluster": {"chief": ["a:1"], "worker": ["A:1"]}}, r"Duplicate address in `cluster.worker\[0\]`"),
        ({"cluster": {}}, r"Empty cluster"),
        ({"cluster": {"worker": [], "ps": []}}, r"Empty cluster"),
        ({"cluster": {"chief": ["a:1", "b:1"]}}, r"`cluster.chief`: 2 addresses. Expected at most one chief"),
        ({"cluster": {"worker": ["a:1"], "evaluator": ["e:1", "f:1"]}}, r"at most one evaluator"),
        ({"cluster": W3, "task": {"type": "ps", "index": 0}}, r"`task.type`. Received: 'ps'.*: worker"),
        ({"cluster": W3, "task": {"type": "boss", "index": 0}}, r"Invalid task type `task.type`"),
        ({"cluster": W3, "task": {"type": "worker", "index": 3}}, r"`task.index`. Received: 3.*0-2"),
        ({"cluster": W3, "task": {"type": "worker", "index": "1"}}, r"`task.index`. Received: '1'"),
        ({"cluster": W3, "task": {"type": "worker"}}, r"Missing `task.index`"),
        ({"cluster": W3, "task": {"type": None, "index": 0}}, r"Missing `task.type`"),
        ({"cluster": W3, "task": ["worker", 0]}, r"Invalid value for `task`"),
    ],
)
def test_bad_tf_config_names_the_key_path(config, match):
    with pytest.raises(ClusterSpecError, match=match) as info:
        ClusterSpec.from_tf_config(config if isinstance(config, str) else json.dumps(config))
    assert "\n" not in str(info.value)


def test_direct_construction_validates_the_task():
    with pytest.raises(ClusterSpecError, match=r"`task_index`. Received: -1"):
        ClusterSpec(W3, "worker", -1)
    with pytest.raises(ClusterSpecError, match=r"`task_index`. Received: True"):
        ClusterSpec(W3, "worker", True)


# --- hosts and hostfiles ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({"workers": ["n1", "n2"]}, {"worker": ("n1:2222", "n2:2222")}),
        ({"workers": "n1,n2:3000", "port": 5000}, {"worker": ("n1:5000", "n2:3000")}),
        ({"workers": ["n1:3", "n2:1"]}, {"worker": ("n1:2222", "n1:2223", "n1:2224", "n2:2222")}),
        (  # bare hosts skip ports given explicitly on the same host
            {"workers": ["n1:2", "n1:2223"], "chief": "n1"},
            {"chief": ("n1:2222",), "worker": ("n1:2224", "n1:2225", "n1:2223")},
        ),
        (
            {"workers": ["w"], "chief": "c:4000", "ps": ["p1", "p2"], "evaluator": "[::1]:4001"},
            {
                "chief": ("c:4000",),
                "worker": ("w:2222",),
                "ps": ("p1:2222", "p2:2222"),
                "evaluator": ("[::1]:4001",),
            },
        ),
    ],
)
def test_from_hosts(kwargs, expected):
    assert ClusterSpec.from_hosts(**kwargs).cluster == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"workers": ["n1:0"]}, r"`workers\[0\]`.*slot count in 1-1023"),
        ({"workers": ["n1:70000"]}, r"`workers\[0\]`.*port in 1024-65535"),
        ({"workers": ["n1", "bad host"]}, r"`workers\[1\]`. Received: 'bad host'"),
        ({"workers": ["n1:3000", "n1:3000"]}, r"Duplicate address in `cluster.worker\[1\]`"),
        ({"workers": ["n1"], "chief": "n2:4"}, r"`chief`.*cannot have slots"),
        ({"workers": ["n1"], "port": 0}, r"`port`. Received: 0"),
        ({"workers": ["n1:3"], "port": 65534}, r"Out of ports for `workers\[0\]`"),
        ({"workers": []}, r"Empty cluster"),
    ],
)
def test_from_hosts_errors(kwargs, match):
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec.from_hosts(**kwargs)


def test_from_hostfile_slots_comments_and_blank_lines(tmp_path):
    path = tmp_path / "hostfile"
    path.write_text(
        "# DeepSpeed-style hostfile\n\nworker-1 slots=2\n  worker-2 slots=1 max_slots=4  # spare\nw3\n"
    )
    spec = ClusterSpec.from_hostfile(path, port=3000)
    assert spec.cluster == {"worker": ("worker-1:3000", "worker-1:3001", "worker-2:3000", "w3:3000")}


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("a slots=2\nb slots=x\n", r"in .*hostfile:2.*slots=N"),
        ("a slots=0\n", r"hostfile:1.*1 <= slots"),
        ("a slots=4 max_slots=2\n", r"hostfile:1.*slots <= max_slots"),
        ("a gpus=4\n", r"hostfile:1.*Received: 'gpus=4'"),
        ("a\nb\na slots=2\n", r"Duplicate host 'a' in .*hostfile:3 \(first on line 1\)"),
        ("# nothing\n\n", r"Empty hostfile"),
        ("a slots=9999999\n", r"Too many tasks"),
    ],
)
def test_from_hostfile_errors_name_the_line(tmp_path, text, match):
    path = tmp_path / "hostfile"
    path.write_text(text)
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec.from_hostfile(path)


def test_from_hostfile_unreadable(tmp_path):
    with pytest.raises(ClusterSpecError, match=r"Cannot read hostfile .*No such file"):
        ClusterSpec.from_hostfile(tmp_path / "missing")
    (tmp_path / "binary").write_bytes(b"\xff\xfe\x00a")
    with pytest.raises(ClusterSpecError, match=r"Cannot read hostfile"):
        ClusterSpec.from_hostfile(tmp_path / "binary")


# --- Slurm --------------------------------------------------------------------------------------


def slurm_env(nodelist, tasks_per_node, procid, ntasks=None, step=True, **extra):
    names = (
        ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS")
        if step
        else ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS")
    )
    env = {names[0]: nodelist, names[1]: tasks_per_node, "SLURM_PROCID": str(procid)}
    if ntasks is not None:
        env[names[2]] = str(ntasks)
    return dict(env, **extra)


# (node list, tasks per node, total tasks): cases TensorFlow's SlurmClusterResolver also handles.
SLURM_CASES = {
    "single-node": ("node1", "1", 1),
    "single-node-4-tasks": ("gpu-7", "4", 4),
    "several-nodes": ("node[1-3]", "2(x3)", 6),
    "uneven": ("n[1-3]", "3,1,2", 6),
    "uneven-repeats": ("n[01-04]", "2(x2),1(x2)", 6),
    "brackets-zero-padded": ("node[001-003,007],node[010-011]", "1(x6)", 6),
    "prefixes": ("a-node[08-10],b-node[1-2]", "2,1(x4)", 6),
}


@pytest.mark.parametrize("case", SLURM_CASES.values(), ids=SLURM_CASES.keys())
def test_from_slurm_agrees_with_tensorflow_slurm_resolver(case):
    nodelist, tasks_per_node, ntasks = case
    for rank in range(ntasks):
        env = slurm_env(nodelist, tasks_per_node, rank, ntasks)
        spec = ClusterSpec.from_slurm(env, port=8888)
        with mock.patch.dict(os.environ, env):
            resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
                port_base=8888, gpus_per_node=ntasks, gpus_per_task=1, auto_set_gpu=False
            )
            tf_cluster = resolver.cluster_spec().as_dict()
        assert {t: list(a) for t, a in spec.cluster.items()} == tf_cluster
        assert (spec.task_type, spec.task_index) == resolver.get_task_info()


def test_from_slurm_keeps_slurm_node_order_where_tensorflow_sorts_names():
    # Slurm's block distribution puts ranks 0-1 on node9; TF's resolver sorts host names
    # as strings, so it puts node10 first and would give rank 0 node10's address.
    env = slurm_env("node[9-10]", "2(x2)", 0, 4)
    spec = ClusterSpec.from_slurm(dict(env, SLURMD_NODENAME="node9", SLURM_LOCALID="0"), port=8888)
    assert spec.cluster["worker"] == ("node9:8888", "node9:8889", "node10:8888", "node10:8889")
    with mock.patch.dict(os.environ, env):
        resolver = tf.distribute.cluster_resolver.SlurmClusterResolver(
            port_base=8888, gpus_per_node=2, gpus_per_task=1, auto_set_gpu=False
        )
        assert resolver.cluster_spec().as_dict()["worker"][0] == "node10:8888"


def test_from_slurm_job_variables_and_cyclic_distribution():
    env = slurm_env("gpu-a[1-2]", "2,1", 1, 3, step=False)
    assert ClusterSpec.from_slurm(env).to_tf_config() == {
        "cluster": {"worker": ["gpu-a1:2222", "gpu-a1:2223", "gpu-a2:2222"]},
        "task": {"type": "worker", "index": 1},
    }
    cyclic = ClusterSpec.from_slurm(dict(env, SLURM_DISTRIBUTION="cyclic"))
    assert cyclic.cluster["worker"] == ("gpu-a1:2222", "gpu-a2:2222", "gpu-a1:2223")
    assert ClusterSpec.from_slurm({"SLURM_NODELIST": "x", "SLURM_TASKS_PER_NODE": "1", "SLURM_PROCID": "0"})


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"SLURM_PROCID": "0"}, r"`SLURM_JOB_NODELIST` is not set"),
        ({"SLURM_STEP_NODELIST": "n1", "SLURM_PROCID": "0"}, r"`SLURM_STEP_TASKS_PER_NODE` is not set"),
        (slurm_env("n[1-2]", "1", 0), r"lists 2 nodes but `SLURM_STEP_TASKS_PER_NODE` describes 1"),
        (slurm_env("n[1-2]", "1(x2)", 0, ntasks=3), r"`SLURM_STEP_NUM_TASKS`=3 but .* adds up to 2"),
        (slurm_env("n[1-2]", "1(x2)", 2), r"`SLURM_PROCID`. Received: '2'. Expected an integer in 0-1"),
        (slurm_env("n[1-2]", "1(x2)", -1), r"`SLURM_PROCID`. Received: '-1'"),
        (slurm_env("n[3-1]", "1", 0), r"low <= high"),
        (slurm_env("n[1-2", "1", 0), r"balanced"),
        (slurm_env("n[1-2],n2", "1(x3)", 0), r"each node once \(repeated: n2\)"),
        (slurm_env("n1", "2(x)", 0), r"`SLURM_STEP_TASKS_PER_NODE`. Received: '2\(x\)'"),
        (slurm_env("n1", "0", 0), r"at least 1"),
        (
            slurm_env("n[1-2]", "1(x2)", 1, SLURMD_NODENAME="n1"),
            r"falls on node 'n2'.*`SLURMD_NODENAME`='n1'",
        ),
        (slurm_env("n1", "2", 1, SLURM_LOCALID="0"), r"`SLURM_LOCALID`='0'"),
        (slurm_env("n1", "1", 0, SLURM_DISTRIBUTION="plane=2"), r"`SLURM_DISTRIBUTION`"),
        (slurm_env("n[1-999999]", "1", 0), r"at most 100000 nodes"),
    ],
)
def test_from_slurm_errors(env, match):
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec.from_slurm(env)


def test_from_slurm_port_range():
    with pytest.raises(ClusterSpecError, match=r"Out of ports: 3 tasks"):
        ClusterSpec.from_slurm(slurm_env("n1", "3", 0), port=65534)
    with pytest.raises(ClusterSpecError, match=r"`port`. Received: 65536"):
        ClusterSpec.from_slurm(slurm_env("n1", "1", 0), port=65536)


# --- Kubernetes ---------------------------------------------------------------------------------


def test_from_kubernetes_passes_tfjob_tf_config_through():
    # What the Kubeflow training operator injects into the pod of worker 1.
    injected = {
        "cluster": {
            "chief": ["mnist-chief-0.ml.svc:2222"],
            "worker": ["mnist-worker-0.ml.svc:2222", "mnist-worker-1.ml.svc:2222"],
        },
        "task": {"type": "worker", "index": 1},
        "environment": "cloud",
    }
    spec = ClusterSpec.from_kubernetes({"TF_CONFIG": json.dumps(injected), "HOSTNAME": "mnist-worker-1"})
    assert spec == ClusterSpec(injected["cluster"], "worker", 1)


def test_from_kubernetes_statefulset_dns_names():
    env = {
        "HOSTNAME": "trainer-2",
        "TFSCALE_REPLICAS": "3",
        "TFSCALE_SERVICE": "trainer",
        "POD_NAMESPACE": "ml",
    }
    spec = ClusterSpec.from_kubernetes(env, port=5000)
    assert spec.cluster["worker"] == tuple(f"trainer-{i}.trainer.ml.svc.cluster.local:5000" for i in range(3))
    assert (spec.task_type, spec.task_index) == ("worker", 2)
    explicit = ClusterSpec.from_kubernetes(
        {"HOSTNAME": "t-0"}, replicas=1, service="h", cluster_domain="c.io"
    )
    assert explicit.cluster["worker"] == ("t-0.h.default.svc.c.io:2222",)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({}, r"`HOSTNAME`. Received: ''"),
        ({"HOSTNAME": "trainer"}, r"'<set>-<ordinal>'"),
        ({"HOSTNAME": "t-0", "TFSCALE_SERVICE": "h"}, r"Missing `replicas`.*`TFSCALE_REPLICAS`"),
        ({"HOSTNAME": "t-3", "TFSCALE_SERVICE": "h", "TFSCALE_REPLICAS": "3"}, r"ordinal 3 but `replicas`=3"),
        ({"HOSTNAME": "t-0", "TFSCALE_SERVICE": "H_", "TFSCALE_REPLICAS": "3"}, r"`service`. Received: 'H_'"),
        ({"TF_CONFIG": '{"cluster": {"worker": []}}'}, r"Empty cluster"),
    ],
)
def test_from_kubernetes_errors(env, match):
    with pytest.raises(ClusterSpecError, match=match):
        ClusterSpec.from_kubernetes(env)


# --- agreement with TensorFlow's TF_CONFIG resolver ---------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        ClusterSpec.from_hosts(workers=["n1:2", "n2:2"]),
        ClusterSpec.from_hosts(workers=["w1", "w2"], chief="c", ps=["p1", "p2"], evaluator="e"),
        ClusterSpec({"chief": ["localhost:1234"]}),
    ],
    ids=["workers", "all-types", "chief-only"],
)
def test_tf_config_cluster_resolver_reads_the_same_cluster_and_task(spec):
    for task_type, index, address in spec.tasks():
        with mock.patch.dict(os.environ, {"TF_CONFIG": spec.to_json(task_type, index)}):
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            assert (resolver.task_type, resolver.task_id) == (task_type, index)
            assert resolver.cluster_spec().as_dict() == {t: list(a) for t, a in spec.cluster.items()}
            assert resolver.cluster_spec().task_address(task_type, index) == address


# --- who this task is: ClusterSpec is the one answer ----------------------------------------------

CPEW = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "ps": ["p:1"], "evaluator": ["e:1"]}
WE = {"worker": ["w:1", "w:2"], "evaluator": ["e:1"]}


@pytest.mark.parametrize(
    ("cluster", "task", "chief", "worker_index", "num_workers", "multi_worker"),
    [
        (CPEW, ("chief", 0), True, 0, 3, True),
        (CPEW, ("worker", 0), False, 1, 3, True),
        (CPEW, ("worker", 1), False, 2, 3, True),
        (CPEW, ("ps", 0), False, None, 3, False),
        (CPEW, ("evaluator", 0), False, None, 3, False),
        (CPEW, (None, None), True, None, 3, False),
        (WE, ("worker", 0), True, 0, 2, True),
        (WE, ("worker", 1), False, 1, 2, True),
        (WE, ("evaluator", 0), False, None, 2, False),
        ({"worker": ["w:1"]}, ("worker", 0), True, 0, 1, False),
        (None, (None, None), True, 0, 1, False),
    ],
    ids=[
        "chief",
        "worker0-with-chief",
        "worker1-with-chief",
        "ps",
        "evaluator-with-chief",
        "no-task",
        "worker0-no-chief",
        "worker1-no-chief",
        "evaluator-no-chief",
        "single-worker",
        "local",
    ],
)
def test_identity_and_writer_rule(cluster, task, chief, worker_index, num_workers, multi_worker):
    spec = ClusterSpec.local() if cluster is None else ClusterSpec(cluster, *task)
    assert (spec.is_chief, spec.worker_index, spec.num_workers, spec.is_multi_worker) == (
        chief,
        worker_index,
        num_workers,
        multi_worker,
    )
    # The writer of backups, the model and logs is the chief (worker 0 without one), and only it.
    assert spec.is_writer is chief


def test_from_env_allow_unset_is_local_and_local_has_no_tasks():
    assert ClusterSpec.from_env({}, allow_unset=True) == ClusterSpec.local()
    assert ClusterSpec.local().is_local and ClusterSpec.local().tasks() == []
    assert not ClusterSpec(W3, "worker", 0).is_local
    with pytest.raises(ClusterSpecError, match="Empty cluster"):
        ClusterSpec({})  # local() is the only way to an empty cluster


@pytest.mark.parametrize(
    "spec",
    [ClusterSpec(CPEW), ClusterSpec(WE)],
    ids=["chief-workers-ps-evaluator", "workers-evaluator"],
)
def test_to_resolver_and_from_resolver_agree_with_tensorflows_tf_config_resolver(spec):
    for task_type, index, _ in spec.tasks():
        mine = spec.with_task(task_type, index)
        resolver = mine.to_resolver()
        with mock.patch.dict(os.environ, {"TF_CONFIG": mine.to_json()}):  # TF reads it lazily
            theirs = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            assert resolver.cluster_spec().as_dict() == theirs.cluster_spec().as_dict()
            assert (resolver.task_type, resolver.task_id) == (theirs.task_type, theirs.task_id)
            assert ClusterSpec.from_resolver(theirs) == mine


def test_a_strategy_outside_a_cluster_is_local():
    assert ClusterSpec.from_strategy(tf.distribute.get_strategy()).is_local
    assert ClusterSpec.from_strategy(tfscale.strategies.get("mirrored", cpu_replicas=2)).is_local


def test_get_rejects_a_cluster_that_is_not_a_cluster_spec():
    with pytest.raises(tfscale.strategies.StrategyError, match=r"`cluster`. Received: cluster=\{'worker'"):
        tfscale.strategies.get("auto", cluster={"worker": ["a:1"]})


@pytest.mark.slow
def test_auto_backups_and_datasets_take_the_task_from_the_spec_without_tf_config():
    results = run_local_cluster(
        workers.identity_from_the_spec_alone, 2, chief=True, timeout=240, env={"TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    got = [r.value for r in results]
    assert [g["multi_worker"] for g in got] == [True] * 3 and [g["replicas"] for g in got] == [3] * 3
    assert [g["resolver_task"] for g in got] == [("chief", 0), ("worker", 0), ("worker", 1)]
    assert [g["backup_role"] for g in got] == [
        ("chief:0", 3, True),
        ("worker:0", 3, False),
        ("worker:1", 3, False),
    ]
    assert [g["dataset_worker"] for g in got] == [(3, 0), (3, 1), (3, 2)]


# --- a real 2-worker multi_worker fit driven by a generated TF_CONFIG ---------------------------


@pytest.mark.slow
def test_generated_tf_config_drives_two_worker_fit():
    ports = _procs.free_ports(2)
    results = run_local_cluster(
        workers.fit_with_generated_tf_config, 2, args=(ports,), timeout=240, env={"TF_CPP_MIN_LOG_LEVEL": "2"}
    )
    expected = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    reference = workers.train(tfscale.strategies.get("one_device", device="/cpu:0"))
    for index, result in enumerate(results):
        value = result.value
        assert json.loads(value["tf_config"]) == {
            "cluster": expected,
            "task": {"type": "worker", "index": index},
        }
        assert value["cluster"] == expected and value["task"] == ("worker", index)
        assert value["replicas"] == 2
        np.testing.assert_allclose(value["loss"], reference["loss"], rtol=1e-5, atol=1e-6)
        for got, want in zip(value["weights"], reference["weights"]):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
