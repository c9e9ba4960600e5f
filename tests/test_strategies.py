"""tfscale.strategies.get: real tf.distribute objects, equivalence, choices and errors."""

import json
import logging
import socket
from unittest import mock

import _foundation_workers as workers
import numpy as np
import pytest
import tensorflow as tf

import tfscale.strategies
from tfscale.strategies import StrategyError, get

RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def one_device_run():
    return workers.train_and_report(get("one_device", device="/cpu:0"))


@pytest.mark.parametrize(
    ("name", "options", "cls", "replicas"),
    [
        ("default", {}, tf.distribute.Strategy, 1),
        ("one_device", {"device": "/cpu:1"}, tf.distribute.OneDeviceStrategy, 1),
        ("mirrored", {"cpu_replicas": 2}, tf.distribute.MirroredStrategy, 2),
        ("mirrored", {"devices": ["/cpu:0", "/cpu:3"]}, tf.distribute.MirroredStrategy, 2),
        (
            "mirrored",
            {"cpu_replicas": 3, "cross_device_ops": "reduction_to_one_device"},
            tf.distribute.MirroredStrategy,
            3,
        ),
    ],
)
def test_builtin_names_return_real_tf_distribute_strategies(name, options, cls, replicas):
    strategy = get(name, **options)
    assert isinstance(strategy, cls)
    assert strategy.num_replicas_in_sync == replicas


def test_cpu_replicas_places_one_replica_per_logical_cpu():
    strategy = get("mirrored", cpu_replicas=4)
    devices = [tf.DeviceSpec.from_string(d) for d in strategy.extended.worker_devices]
    assert [(d.device_type, d.device_index) for d in devices] == [("CPU", i) for i in range(4)]


@pytest.mark.parametrize("cpu_replicas", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_mirrored_on_cpu_replicas_matches_one_device(one_device_run, cpu_replicas):
    run = workers.train_and_report(get("mirrored", cpu_replicas=cpu_replicas))
    assert run["replicas"] == cpu_replicas
    for got, want in zip(run["weights"], one_device_run["weights"]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    for key, want in one_device_run["history"].items():
        np.testing.assert_allclose(run["history"][key], want, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(run["predict"], one_device_run["predict"], rtol=RTOL, atol=ATOL)
    # The run really trained: weights moved away from their initial values.
    initial = workers.build_model().get_weights()
    assert max(np.max(np.abs(a - b)) for a, b in zip(run["weights"], initial)) > 1e-2


def _tf_config(*workers_addresses, index=0):
    return json.dumps(
        {"cluster": {"worker": list(workers_addresses)}, "task": {"type": "worker", "index": index}}
    )


@pytest.mark.parametrize(
    ("environ", "options", "cls", "replicas", "reason"),
    [
        ({}, {}, tf.distribute.OneDeviceStrategy, 1, "one_device"),
        ({"TF_CONFIG": _tf_config("127.0.0.1:1")}, {}, tf.distribute.OneDeviceStrategy, 1, "one_device"),
        ({}, {"cpu_replicas": 2}, tf.distribute.MirroredStrategy, 2, "cpu_replicas"),
    ],
    ids=["no-TF_CONFIG", "TF_CONFIG-one-task", "cpu_replicas=2"],
)
def test_auto_chooses_from_the_environment(caplog, environ, options, cls, replicas, reason):
    # The two-worker case needs a real cluster: tests/test_multi_worker.py runs "auto" there.
    with mock.patch.dict("os.environ", environ, clear=True), caplog.at_level(logging.INFO, "tfscale"):
        strategy = get("auto", **options)
    assert type(strategy) is cls
    assert strategy.num_replicas_in_sync == replicas
    assert "strategy auto ->" in caplog.text and reason in caplog.text


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    ("name", "options", "match"),
    [
        ("horovod", {}, r"Unknown strategy name\. Received: name='horovod'\. Expected one of \['auto'"),
        (
            "mirrored",
            {"num_replica": 2},
            r"Unknown option\(s\) \['num_replica'\] for strategy 'mirrored'.*cpu_replicas",
        ),
        ("default", {"cpu_replicas": 2}, r"Unknown option\(s\) \['cpu_replicas'\] for strategy 'default'"),
        ("mirrored", {"cpu_replicas": 0}, r"cpu_replicas=0\. Expected a positive integer"),
        (
            "mirrored",
            {"cpu_replicas": 2, "devices": ["/cpu:0"]},
            r"`devices`, `cpu_replicas` of strategy "
            r"'mirrored' exclude each other",
        ),
        ("mirrored", {"num_gpus": 1}, r"num_gpus=1\. Expected no `num_gpus`: no GPU is visible here"),
        (
            "mirrored",
            {"cross_device_ops": "ring"},
            # The spec's order, as `--cross_device_ops` lists them.
            r"cross_device_ops='ring'\. Expected one of \['nccl', 'hierarchical_copy', "
            r"'reduction_to_one_device'\]\.$",
        ),
        ("mirrored", {"cross_device_ops": "nccl"}, r"`cross_device_ops='nccl'` needs GPUs"),
        (
            "multi_worker",
            {"communication": "mpi"},
            r"communication='mpi'\. Expected one of \['auto', 'ring', 'nccl'\]\.$",
        ),
        ("multi_worker", {"timeout_seconds": -1}, r"timeout_seconds=-1\. Expected a positive number"),
        ("one_device", {"device": "not a device"}, r"device='not a device'\. Expected a device name"),
        ("tpu", {"tpu": "my-tpu-name"}, r"No TPU reachable at `tpu='my-tpu-name'`"),
        ("tpu", {}, r"No TPU reachable at `tpu=None`"),
        # The classes' own options too: a StrategyError, not Python's TypeError.
        ("model_split", {"foo": 1}, r"Unknown option\(s\) \['foo'\] for strategy 'model_split'.*balance"),
        ("pipeline", {"stages": 2}, r"Unknown option\(s\) \['stages'\] for strategy 'pipeline'.*num_stages"),
    ],
)
def test_bad_input_is_one_clear_error(name, options, match):
    with pytest.raises(StrategyError, match=match) as raised:
        get(name, **options)
    assert "\n" not in str(raised.value)
    assert isinstance(raised.value, ValueError)


def test_unreachable_tpu_address_fails_fast_naming_it():
    address = f"grpc://127.0.0.1:{_closed_port()}"
    with pytest.raises(StrategyError, match=f"No TPU reachable at `tpu='{address}'`"):
        get("tpu", tpu=address)


def test_cpu_replicas_beyond_an_initialized_split_says_it_is_too_late():
    tf.config.list_logical_devices("CPU")  # starts the runtime with conftest's 4 devices
    with pytest.raises(
        StrategyError,
        match=r"`cpu_replicas=8` needs 8 logical CPU devices, but TensorFlow is already initialized with 4",
    ):
        get("mirrored", cpu_replicas=8)


def test_split_cpu_reuses_a_larger_existing_split():
    assert tfscale.strategies.split_cpu(2) == ["/device:CPU:0", "/device:CPU:1"]
    assert len(tf.config.list_logical_devices("CPU")) == 4


def test_auto_rejects_a_malformed_tf_config_instead_of_guessing():
    bad = json.dumps({"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2222"]}})
    with mock.patch.dict("os.environ", {"TF_CONFIG": bad}), pytest.raises(ValueError, match="uplicate"):
        get("auto")


def test_the_docs_table_lists_every_strategy_name():
    # The names themselves are tfscale._strategy_spec's, which --strategy offers too
    # (tests/test_strategy_spec.py).
    import os
    import re

    page = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "strategies.md")
    with open(page) as f:
        table = re.findall(r'^\| `"(\w+)"` \|', f.read(), re.MULTILINE)
    assert table == list(tfscale.strategies.NAMES)
