"""Every flag of the README's `tfscale-train` table, through the real binary, with an effect.

Binaries cost 10-50 s each here, so one run carries several flags whose effects can be
told apart: in the printed result (batch, steps, replicas, sharding, learning rate) and in
the saved `model.keras` (model, optimizer, dtype policy, `jit_compile`,
`steps_per_execution` as Keras compiled it). The shipped flagfiles and
`examples/quickstart.py` run end to end, checked against the numbers the README gives.
"""

import json
import os
import re
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from tfscale.train import RESULT_PREFIX

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(BIN, "tfscale-train")
LAUNCH = os.path.join(BIN, "tfscale-launch")
FLAGFILES = os.path.join(REPO, "flagfiles")
TIMEOUT = 400
# A one-task cluster: --tf_config names this process's task without starting a multi-worker job.
ONE_TASK = json.dumps({"cluster": {"worker": ["localhost:2222"]}, "task": {"type": "worker", "index": 0}})


def _run(command, data_dir, cwd=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", TFSCALE_DATA_DIR=data_dir)
    proc = subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=cwd, timeout=TIMEOUT, check=False
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def _result(stdout):
    (line,) = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(line[len(RESULT_PREFIX) :])


def _cluster_results(stdout):
    """{task index: result} from the launcher's `[worker:N] ...` prefixed lines."""
    found = re.findall(rf"^\[worker:(\d+)\] {re.escape(RESULT_PREFIX)}(.*)$", stdout, re.MULTILINE)
    return {int(index): json.loads(text) for index, text in found}


def _saved_config(model_dir):
    """The model config Keras saved in `model.keras` (architecture and compile arguments)."""
    with zipfile.ZipFile(os.path.join(model_dir, "model.keras")) as archive:
        return json.loads(archive.read("config.json"))


def _dtype_policies(config):
    """The dtype policies of the layers (the input layer holds a plain dtype, some ops none)."""
    dtypes = [layer["config"].get("dtype") for layer in config["config"]["layers"]]
    return {d["config"]["name"] for d in dtypes if isinstance(d, dict)}


@pytest.mark.slow  # 8 s; fast tier: the flagfile and quickstart runs here
def test_performance_and_training_flags_on_one_device(data_dir, tmp_path):
    model_dir = tmp_path / "out"
    proc = _run(
        [
            TRAIN, "--strategy=one_device", "--model=cnn", "--optimizer=sgd", "--learning_rate=0.01",
            "--mixed_precision=mixed_bfloat16", "--jit_compile", "--steps_per_execution=3",
            "--per_replica_batch_size=16", "--steps_per_epoch=6", "--epochs=2",
            f"--data_dir={data_dir}", f"--model_dir={model_dir}",
        ],
        data_dir,
    )  # fmt: skip
    result = _result(proc.stdout)
    assert (result["global_batch_size"], result["steps_per_epoch"], result["epochs"]) == (16, 6, 2)
    assert len(result["history"]["loss"]) == 2
    config = _saved_config(model_dir)
    assert config["config"]["name"] == "cnn"
    assert {"Conv2D", "MaxPooling2D"} <= {layer["class_name"] for layer in config["config"]["layers"]}
    compiled = config["compile_config"]
    assert compiled["optimizer"]["class_name"] == "SGD"
    np.testing.assert_allclose(compiled["optimizer"]["config"]["learning_rate"], 0.01, rtol=1e-6)
    assert (compiled["jit_compile"], compiled["steps_per_execution"]) == (True, 3)
    assert _dtype_policies(config) == {"mixed_bfloat16", "float32"}  # float32: the logits


@pytest.mark.slow  # 27 s; fast tier: test_train's mirrored run of the binary
def test_strategy_flags_and_the_transformer_on_two_replicas(data_dir, tmp_path):
    model_dir = tmp_path / "out"
    proc = _run(
        [
            TRAIN, "--strategy=mirrored", "--cpu_replicas=2", "--cross_device_ops=reduction_to_one_device",
            "--model=transformer", "--optimizer=adamw", "--learning_rate=0.001", "--lr_scaling=linear",
            "--mixed_precision=mixed_float16", "--per_replica_batch_size=8", "--steps_per_epoch=4",
            "--epochs=2", "--lr_warmup_epochs=2", "--seed=3", "--shuffle_buffer=64", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", f"--tf_config={ONE_TASK}",
        ],
        data_dir,
    )  # fmt: skip
    result = _result(proc.stdout)
    assert result["strategy"] == "mirrored (MirroredStrategy)" and result["num_replicas"] == 2
    assert (result["task"], result["num_workers"], result["is_chief"]) == ("worker:0", 1, True)
    assert (result["global_batch_size"], result["steps_per_epoch"]) == (16, 4)  # 8 per replica x 2
    # Linear scaling with warmup: from 0.001 to 0.001 x 2 replicas over 2 epochs of 4 steps.
    np.testing.assert_allclose(result["history"]["learning_rate"], [0.0015, 0.002], rtol=1e-5)
    config = _saved_config(model_dir)
    assert config["config"]["name"] == "transformer"
    assert "MultiHeadAttention" in {layer["class_name"] for layer in config["config"]["layers"]}
    assert config["compile_config"]["optimizer"]["class_name"] == "AdamW"
    assert _dtype_policies(config) == {"mixed_float16", "float32"}


def test_steps_per_execution_under_mirrored_is_one_clear_error(data_dir, tmp_path):
    # Keras 3.15.1 crashes in fit there (keras-team/keras#19246): tfscale-train says so in one line.
    command = [TRAIN, "--strategy=mirrored", "--cpu_replicas=2", "--steps_per_execution=2", "--epochs=1"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFSCALE_DATA_DIR=data_dir)
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("tfscale-train: error:")]
    assert errors == [
        "tfscale-train: error: `steps_per_execution=2` cannot run under strategy 'mirrored' with 2 replicas "
        "(Keras 3 fails in fit: keras-team/keras#19246). "
        "Expected steps_per_execution=1 there, or one replica."
    ]
    assert "Traceback" not in proc.stderr


def _flagfile_run(name, data_dir, cwd):
    return _result(_run([TRAIN, f"--flagfile={os.path.join(FLAGFILES, name)}"], data_dir, cwd).stdout)


def _assert_same_metrics(got, want):
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got["history"][key], want["history"][key], rtol=1e-4, atol=1e-6)
    for key, value in want["evaluation"].items():
        np.testing.assert_allclose(got["evaluation"][key], value, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def one_device_cfg(data_dir, tmp_path_factory):
    return _flagfile_run("one_device.cfg", data_dir, str(tmp_path_factory.mktemp("cwd")))


def test_one_device_flagfile_trains_the_digits_as_the_readme_says(one_device_cfg):
    result = one_device_cfg
    assert result["strategy"] == "one_device (OneDeviceStrategy)"
    assert (result["epochs"], result["steps_per_epoch"], result["global_batch_size"]) == (10, 24, 64)
    assert result["history"]["accuracy"][-1] > 0.97  # README: 0.9902; chance 0.1
    assert result["evaluation"]["test_accuracy"] > 0.85  # README: 0.9004
    assert result["model_path"] is None  # the flagfile names no --model_dir


@pytest.mark.slow
def test_mirrored_flagfile_matches_the_one_device_flagfile(one_device_cfg, data_dir, tmp_path):
    result = _flagfile_run("mirrored.cfg", data_dir, str(tmp_path))
    assert result["strategy"] == "mirrored (MirroredStrategy)" and result["num_replicas"] == 2
    _assert_same_metrics(result, one_device_cfg)


@pytest.mark.slow
def test_multi_worker_flagfile_under_the_launcher_matches_the_one_device_flagfile(
    one_device_cfg, data_dir, tmp_path
):
    command = [
        LAUNCH,
        "--num_workers=2",
        "--",
        TRAIN,
        f"--flagfile={os.path.join(FLAGFILES, 'multi_worker.cfg')}",
    ]
    results = _cluster_results(_run(command, data_dir, str(tmp_path)).stdout)
    assert sorted(results) == [0, 1]
    for result in results.values():
        assert (result["num_workers"], result["num_replicas"], result["sharding"]) == (2, 2, "data")
        _assert_same_metrics(result, one_device_cfg)


@pytest.mark.slow
def test_sharding_files_communication_and_rmsprop_on_two_workers(data_dir, tmp_path):
    model_dir = tmp_path / "out"
    command = [
        LAUNCH, "--num_workers=2", "--", TRAIN, "--strategy=multi_worker", "--communication=ring",
        "--sharding=files", "--optimizer=rmsprop", "--epochs=1", f"--data_dir={data_dir}",
        f"--model_dir={model_dir}",
    ]  # fmt: skip
    results = _cluster_results(_run(command, data_dir, str(tmp_path)).stdout)
    assert sorted(results) == [0, 1]
    # "auto" would pick "data" for the in-memory digits (test_multi_worker_flagfile_... above).
    assert {r["sharding"] for r in results.values()} == {"files"}
    # Each worker reads half the files: 1536 examples / 2 workers / 64 per global batch x 2 workers.
    assert {r["steps_per_epoch"] for r in results.values()} == {24}
    assert _saved_config(model_dir)["compile_config"]["optimizer"]["class_name"] == "RMSprop"


def test_quickstart_example_trains_to_high_accuracy(data_dir, tmp_path):
    proc = _run([sys.executable, os.path.join(REPO, "examples", "quickstart.py")], data_dir, str(tmp_path))
    assert "strategy: MirroredStrategy, replicas: 2" in proc.stdout
    loss, accuracy = map(float, re.search(r"final loss: ([\d.]+), accuracy: ([\d.]+)", proc.stdout).groups())
    assert accuracy > 0.95 and loss < 0.15, proc.stdout[-1000:]  # a linearly separable label
