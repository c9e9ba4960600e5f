"""tfscale.horovod: Horovod's API on Keras 3, checked against plain Keras on one process.

The cluster tests run real Horovod-style scripts (tests/_horovod_workers.py) under the
`tfscale-launch -np N` binary; one 2-rank job serves most assertions (each TF process
start costs seconds). Rank 0 of that job also trains the single-process references.
The fast tier checks the same API at size 1 in this process.
"""

import json
import os
import re
import subprocess
import sys
import time
from unittest import mock

import numpy as np
import pytest
from _launch_util import leftovers, new_marker, run_launcher

from tfscale.cluster import ClusterSpec

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "_horovod_workers.py")
ATOL = 1e-5  # fp32; the averaged gradients differ from one process's by round-off only


def _load(out, rank):
    with np.load(os.path.join(out, f"rank{rank}.npz")) as f:
        arrays = {k: f[k] for k in f.files}
    with open(os.path.join(out, f"rank{rank}.json")) as f:
        return arrays, json.load(f)


def _weights(arrays, key):
    return [arrays[f"{key}/{i}"] for i in range(sum(k.startswith(f"{key}/") for k in arrays))]


# A network namespace of its own (loopback only): the job's loopback byte counter then counts
# this job's traffic alone, not that of tests running beside it (CI's stop 37 read 1.3x for
# fp16/none while other xdist workers talked gRPC on the shared loopback).
PRIVATE_NET = ("unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh")


def _private_net_or_skip():
    probe = subprocess.run([*PRIVATE_NET, "true"], capture_output=True, text=True, check=False)
    if probe.returncode == 0:
        return PRIVATE_NET
    message = f"cannot make a private network namespace (needs root and `unshare`): {probe.stderr.strip()}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{message}; CI must run the Horovod cluster tests")
    pytest.skip(message)


def _run_job(tmp_path, np_, mode, *extra, launcher_args=(), prefix=()):
    marker = new_marker()
    out = tmp_path / "out"
    out.mkdir()
    run = run_launcher(
        ["-np", str(np_), *launcher_args, sys.executable, WORKERS, mode, str(out), *extra],
        marker,
        timeout=600,
        prefix=prefix,
    )
    assert leftovers(marker) == [], "processes started by the launcher outlived it"
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    return run, [_load(out, r) for r in range(np_)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return _run_job(tmp_path_factory.mktemp("hvd2"), 2, "main", prefix=_private_net_or_skip())[1]


def _assert_same_on_all_ranks_and_as_reference(ranks, key):
    reference = _weights(ranks[0][0], f"{key}_ref")
    assert reference, f"no reference weights for {key}"
    for rank, (arrays, _) in enumerate(ranks):
        weights = _weights(arrays, key)
        for w, w0 in zip(weights, _weights(ranks[0][0], key)):
            np.testing.assert_array_equal(w, w0, err_msg=f"rank {rank} differs from rank 0 ({key})")
        for w, r in zip(weights, reference):
            np.testing.assert_allclose(w, r, atol=ATOL, rtol=0, err_msg=f"{key} differs from one process")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["fit", "loop", "loop_eager", "passes"])
def test_two_ranks_end_identical_and_equal_one_process_on_the_concatenated_batches(two_ranks, key):
    # fit: DistributedOptimizer + the 4 callbacks, ranks starting from different weights;
    # loop: DistributedGradientTape in a tf.function + broadcast_variables after step 1
    # (loop_eager: the same loop run eagerly);
    # passes: backward_passes_per_step=2 against one process with twice the batch.
    _assert_same_on_all_ranks_and_as_reference(two_ranks, key)


@pytest.mark.slow
def test_backward_passes_count_applied_updates_like_the_double_batch_run(two_ranks):
    info = two_ranks[0][1]
    assert info["iterations_passes"] == info["iterations_ref"] == 12


@pytest.mark.slow
def test_metric_average_callback_logs_the_mean_over_ranks(two_ranks):
    raws = [info["raw"] for _, info in two_ranks]
    for epoch in range(len(raws[0])):
        mean = np.mean([raw[epoch]["loss"] for raw in raws])
        assert raws[0][epoch]["loss"] != pytest.approx(raws[1][epoch]["loss"])  # shards differ
        for _, info in two_ranks:
            assert info["history"]["loss"][epoch] == pytest.approx(mean, abs=1e-6)
        # and that mean is the loss one process reports on the concatenated batches
        assert two_ranks[0][1]["ref_history"]["loss"][epoch] == pytest.approx(mean, abs=ATOL)


@pytest.mark.slow
def test_fp16_compression_halves_the_bytes_of_each_allreduce(two_ranks):
    for _, info in two_ranks:
        none, fp16 = info["compression"]["none"], info["compression"]["fp16"]
        assert fp16["dtype"] == "float32"  # cast back after the all-reduce
        assert fp16["launch_bytes"] / none["launch_bytes"] == pytest.approx(0.5, abs=0.01)
        # What went over loopback (all traffic of the job's own network namespace: a ceiling).
        assert fp16["loopback_bytes"] / none["loopback_bytes"] == pytest.approx(0.5, abs=0.1)


@pytest.mark.slow
def test_mismatched_shapes_and_dtypes_fail_on_every_rank_with_one_line(two_ranks):
    expected = {
        "allreduce_shape": "allreduce: ranks disagree on tensor 'grad': rank 0 has float32[2,3], rank 1 has "
        "float32[3,3]",
        "broadcast_dtype": "rank 0 has float64[4], rank 1 has float32[4]",
        "allgather_inner": "rank 0 has float32[?,1], rank 1 has float32[?,2]",
    }
    for _, info in two_ranks:
        for case, text in expected.items():
            message = info["mismatch"][case]
            assert message is not None and text in message and "\n" not in message, (case, message)
        assert info["mismatch"]["after"] == 3.0  # 1 + 2: the collectives still work
        assert info["mismatch"]["allgather_ragged"] == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]


@pytest.mark.slow
def test_identity_comes_from_the_launcher_cluster(two_ranks):
    assert [info["identity"] for _, info in two_ranks] == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]


@pytest.mark.slow
def test_four_ranks_end_identical_and_equal_one_process(tmp_path):
    _, ranks = _run_job(tmp_path, 4, "main")
    for key in ("fit", "loop", "passes"):
        _assert_same_on_all_ranks_and_as_reference(ranks, key)


@pytest.mark.slow
def test_rank_killed_mid_run_resumes_exactly_under_max_restarts(tmp_path):
    run, ranks = _run_job(
        tmp_path,
        2,
        "resume",
        str(tmp_path / "backup"),
        launcher_args=("--max_restarts", "1", "--restart_backoff", "0"),
    )
    assert "rank 1: SIGKILL at epoch 1 batch 2" in run.stdout
    assert "job succeeded in attempt 2 of 2" in run.stderr
    for _, info in ranks:
        assert info["attempt"] == 1 and info["restored_step"] == 9  # 6 + 3 steps, saved every step
    _assert_same_on_all_ranks_and_as_reference(ranks, "fit")


@pytest.mark.slow
def test_missing_peer_fails_in_bounded_time_naming_it(tmp_path):
    from tfscale.launch._procs import free_ports

    ports = free_ports(2)
    config = ClusterSpec({"worker": [f"127.0.0.1:{p}" for p in ports]}).to_json("worker", 0)
    env = dict(os.environ, TF_CONFIG=config, HOROVOD_START_TIMEOUT="3", TF_CPP_MIN_LOG_LEVEL="2")
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-c", "import tfscale.horovod as hvd; hvd.init()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    elapsed = time.monotonic() - start
    assert run.returncode != 0
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "tfscale.horovod._basics.StartTimeoutError: hvd.init on rank 0 waited 3 s for "
        f"rank 1 (worker:1 at 127.0.0.1:{ports[1]}), which never started."
    ), last
    assert elapsed < 60


@pytest.mark.slow
def test_init_after_tensorflow_started_is_one_line():
    marker = new_marker()
    code = "import tensorflow as tf; tf.constant(1.0) + 1; import tfscale.horovod as hvd; hvd.init()"
    run = run_launcher(["-np", "2", sys.executable, "-c", code], marker, timeout=300)
    assert run.returncode == 1
    # The first rank to fail ends the job; the launcher stops the other one.
    lines = [line for line in run.stdout.splitlines() if "] tfscale.horovod._errors.HorovodError: " in line]
    assert lines and all("hvd.init() ran after TensorFlow started" in line for line in lines), run.stdout[
        -3000:
    ]
    assert leftovers(marker) == []


@pytest.mark.slow
def test_hvd_run_returns_each_rank_value():
    from _horovod_workers import run_target

    import tfscale.horovod as hvd

    assert hvd.run(run_target, args=(1.5,), np=2) == [(0, 2, 4.5), (1, 2, 4.5)]


@pytest.mark.slow
def test_compat_tf_collectives_supported_on_this_tensorflow():
    # A fresh process: a MultiWorkerMirroredStrategy configures this process's collectives.
    code = (
        "import tensorflow as tf\n"
        "from tfscale.compat import tf_collectives as c\n"
        "s = tf.distribute.MultiWorkerMirroredStrategy()\n"
        "assert c.supported(s)\n"
        "ops = c.Collectives(s)\n"
        "total, gathered = ops.all_reduce_sum([tf.ones([2])])[0], ops.all_gather(tf.ones([1, 2]))\n"
        "print(total.numpy().tolist(), gathered.shape)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[1.0, 1.0] (1, 2)"


# Fast tier: the same API at size 1 (no TF_CONFIG), in this process.


@pytest.fixture
def hvd():
    with mock.patch.dict(os.environ):
        os.environ.pop("TF_CONFIG", None)
        import tfscale.horovod as hvd

        hvd.init()
        yield hvd
        hvd.shutdown()


def test_size_one_fit_with_distributed_optimizer_equals_plain_keras(hvd):
    import keras
    from _horovod_workers import data, model, weights

    x, y = data(1)

    def fit(wrap, passes, batch):
        m = model(3)
        opt = keras.optimizers.Adam(0.01)
        if wrap:
            opt = hvd.DistributedOptimizer(
                opt, backward_passes_per_step=passes, average_aggregated_gradients=True
            )
        m.compile(opt, "mse")
        callbacks = [hvd.callbacks.BroadcastGlobalVariablesCallback(0), hvd.callbacks.MetricAverageCallback()]
        m.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0, callbacks=callbacks if wrap else [])
        return weights(m)

    plain = fit(False, 1, 8)
    for w, p in zip(fit(True, 1, 8), plain):
        np.testing.assert_allclose(w, p, atol=ATOL, rtol=0)
    for w, p in zip(fit(True, 2, 4), plain):  # two passes of 4 = one batch of 8
        np.testing.assert_allclose(w, p, atol=ATOL, rtol=0)
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_size()) == (0, 1, 0, 1, 1)


def test_model_saved_with_distributed_optimizer_loads_as_plain_keras(hvd, tmp_path):
    import keras
    from _horovod_workers import data, model

    x, y = data(1, steps=1)
    m = model(3)
    m.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)), "mse")
    m.fit(x, y, batch_size=8, epochs=1, verbose=0)
    m.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert type(loaded.optimizer) is keras.optimizers.SGD
    np.testing.assert_allclose(loaded.predict(x, verbose=0), m.predict(x, verbose=0), atol=ATOL)


def test_size_one_collectives_return_their_input(hvd):
    import tensorflow as tf

    x = tf.constant([1.5, 2.5])
    np.testing.assert_array_equal(hvd.allreduce(x), x)
    np.testing.assert_array_equal(hvd.allreduce(x, compression=hvd.Compression.fp16), x)
    np.testing.assert_array_equal(hvd.allreduce(x, "keras_spelling_name"), x)
    np.testing.assert_array_equal(hvd.allgather(x), x)
    np.testing.assert_array_equal(hvd.broadcast(x, 0), x)
    assert hvd.broadcast_object({"epoch": 3}, 0) == {"epoch": 3}
    np.testing.assert_array_equal(tf.function(lambda t: hvd.grouped_allreduce([t, t], op=hvd.Sum))(x)[1], x)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda hvd: hvd.allreduce([1.0], op=hvd.__getattr__("Adasum")), "`hvd.Adasum` is not provided"),
        (lambda hvd: hvd.allreduce([1.0], op="Min"), "Expected hvd.Average or hvd.Sum"),
        (lambda hvd: hvd.allreduce([1.0], compression="fp16"), "Received: compression='fp16'"),
        (lambda hvd: hvd.broadcast([1.0], root_rank=1), r"root_rank=1\. Expected a rank from 0 to 0"),
        (lambda hvd: hvd.DistributedOptimizer("sgd"), "Expected a Keras 3 optimizer"),
        (
            lambda hvd: hvd.DistributedOptimizer(_sgd(), backward_passes_per_step=0),
            "backward_passes_per_step=0",
        ),
        (lambda hvd: hvd.DistributedOptimizer(_sgd(), num_groups=2), "num_groups=2"),
        (lambda hvd: hvd.elastic, r"Use `tfscale-launch --num_workers MIN:MAX`"),
        (lambda hvd: hvd.ProcessSet, "every collective spans all ranks"),
        (lambda hvd: hvd.callbacks.BestModelCheckpoint, r"ModelCheckpoint\(save_best_only=True\)"),
        (lambda hvd: hvd.init(comm=[0, 1]), "Invalid value for argument `comm`"),
    ],
)
def test_unsupported_horovod_calls_are_one_line_errors(hvd, call, match):
    with pytest.raises(hvd.HorovodError, match=match) as e:
        call(hvd)
    assert "\n" not in str(e.value)


def _sgd():
    import keras

    return keras.optimizers.SGD(0.1)


def test_unknown_names_stay_attribute_errors(hvd):
    assert not hasattr(hvd, "no_such_name")
    assert not hasattr(hvd.callbacks, "no_such_callback")


def test_calls_before_init_and_timeline_variable_are_errors():
    import tfscale.horovod as hvd

    hvd.shutdown()
    with pytest.raises(hvd.HorovodError, match=r"not been initialized. Expected `hvd.init\(\)`"):
        hvd.rank()
    with mock.patch.dict(os.environ, {"HOROVOD_TIMELINE": "/tmp/t.json"}):
        with pytest.raises(hvd.HorovodError, match=r"HOROVOD_TIMELINE.*CommunicationProfiler"):
            hvd.init()


@pytest.mark.parametrize(
    ("workers", "task", "expected"),
    [
        (["a:1000", "a:1001", "b:1000", "b:1001"], 2, (2, 4, 0, 2, 1, 2)),
        (["a:1000", "b:1000", "a:1001"], 2, (2, 3, 1, 2, 0, 2)),
        (["a:1000"], 0, (0, 1, 0, 1, 0, 1)),
    ],
)
def test_local_and_cross_ranks_come_from_the_cluster_spec(workers, task, expected):
    from tfscale.horovod._basics import identity_of

    got = identity_of(ClusterSpec({"worker": workers}, "worker", task))
    assert tuple(vars(got).values()) == expected


def test_chief_is_rank_zero_and_an_evaluator_has_no_rank():
    from tfscale.horovod import HorovodError
    from tfscale.horovod._basics import identity_of

    cluster = {"chief": ["c:1000"], "worker": ["w:1000"], "evaluator": ["e:1000"]}
    assert identity_of(ClusterSpec(cluster, "worker", 0)).rank == 1
    with pytest.raises(HorovodError, match="Task evaluator:0 has no Horovod rank"):
        identity_of(ClusterSpec(cluster, "evaluator", 0))


def test_launcher_takes_horovodrun_spellings(tmp_path):
    marker = new_marker()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=2\nlocalhost slots=2\n")
    show = "import os; print('CONFIG', os.environ['TF_CONFIG'])"
    cases = [
        (["-np", "2", sys.executable, "-c", show], ["127.0.0.1"] * 2),
        (["-np", "3", "-H", "127.0.0.1:2,localhost:2", "--remote_cmd", "env", sys.executable, "-c", show],
         ["127.0.0.1", "127.0.0.1", "localhost"]),
        (["-np", "1", "--hostfile", str(hostfile), "--remote_cmd", "env", "--", sys.executable, "-c", show],
         ["127.0.0.1"]),
    ]  # fmt: skip
    for args, hosts in cases:
        run = run_launcher(args, marker)
        assert run.returncode == 0, run.stderr
        configs = [
            json.loads(line.split("CONFIG ", 1)[1]) for line in run.stdout.splitlines() if "CONFIG" in line
        ]
        assert sorted(c["task"]["index"] for c in configs) == list(range(len(hosts)))
        assert [a.rpartition(":")[0] for a in configs[0]["cluster"]["worker"]] == hosts
    run = run_launcher(["-np", "5", "-H", "127.0.0.1:2,localhost:2", "true"], marker)
    assert run.returncode == 2
    assert re.fullmatch(
        r"tfscale-launch: error: .*`--num_workers`=5 with a multi-host job of 4 slots.*\n", run.stderr
    )
    assert leftovers(marker) == []
