"""tfscale.strategies._devices: device discovery never starts TensorFlow's runtime.

Each strategy name is created with its default devices in a fresh process, as the README's
snippets do (strategy first, then the model): if discovery started the runtime, the host CPU
could no longer be split and the pipeline / model-split / `cpu_replicas` strategies would
fail there. The in-process tests cannot see this: conftest.py splits the CPU first.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import tensorflow as tf

from tfscale.strategies import StrategyError
from tfscale.strategies._devices import device_key, local_device_names, resolve_devices

_SCRIPT = textwrap.dedent(
    """
    import sys
    import numpy as np, keras, tfscale
    name, options = sys.argv[1], eval(sys.argv[2])
    strategy = tfscale.strategies.get(name, **options)
    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1)])
    if name in ("pipeline", "model_split"):
        model = strategy.split(build())
    else:
        with strategy.scope():
            model = build()
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((8, 4), "float32")
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    devices = getattr(strategy, "devices", None) or strategy.extended.worker_devices
    print("devices", len(devices))
    """
)


@pytest.mark.parametrize(
    ("name", "options", "num_devices"),
    [
        ("pipeline", {"num_stages": 2, "num_microbatches": 2}, 2),  # the fast tier's fresh process
        pytest.param("model_split", {"num_devices": 2}, 2, marks=pytest.mark.slow),
        pytest.param("mirrored", {"cpu_replicas": 2}, 2, marks=pytest.mark.slow),
        pytest.param("one_device", {}, 1, marks=pytest.mark.slow),
        pytest.param("auto", {}, 1, marks=pytest.mark.slow),
    ],
)
def test_default_devices_work_in_a_fresh_process(name, options, num_devices, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    env.update(CUDA_VISIBLE_DEVICES="-1", TF_CPP_MIN_LOG_LEVEL="2")
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, name, repr(options)],
        check=False,
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"devices {num_devices}" in result.stdout


def test_discovery_counts_the_split_host_cpu():
    assert local_device_names("CPU") == [d.name for d in tf.config.list_logical_devices("CPU")]
    assert local_device_names("GPU") == [d.name for d in tf.config.list_logical_devices("GPU")]


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("/cpu:1", "/device:CPU:1"),
        ("/job:localhost/replica:0/task:0/device:CPU:1", "/CPU:1"),
    ],
)
def test_device_key_is_one_per_device_however_spelled(a, b):
    assert device_key(a) == device_key(b)


def test_device_key_keeps_remote_tasks_apart():
    local, remote = "/device:CPU:0", "/job:worker/replica:0/task:1/device:CPU:0"
    assert device_key(local) != device_key(remote)
    # Not connected to a cluster (tests/test_hybrid_cluster.py connects to one): a remote
    # task's device is checked against the devices this process can reach, and is not one.
    with pytest.raises(StrategyError, match=r"task worker:1 is not in the cluster .*connect_cluster"):
        resolve_devices([remote], 1, count_argument="num_stages", distinct=False)


def test_resolved_devices_follow_each_strategy_rule():
    assert resolve_devices(["/cpu:0", "/cpu:0"], 2, count_argument="num_stages", distinct=False) == [
        "/device:CPU:0",
        "/device:CPU:0",
    ]
    with pytest.raises(StrategyError, match="Expected distinct devices"):
        resolve_devices(["/cpu:0", "/cpu:0"], None, count_argument="num_devices", distinct=True)
    with pytest.raises(StrategyError, match=r"`num_devices`.*num_devices=0"):
        resolve_devices(None, 0, count_argument="num_devices", distinct=True)
