"""`tfscale-train --strategy=pipeline|model_split`: the flags, one line per bad input, and
a pipelined DP2 x PP2 run (with a backup, killed and resumed) equal to one device.

In process (`train(...)`, `run([...])`), like tests/test_train.py: a binary costs 15-20 s
here. The reference is `--strategy=default` on the same flags: the same global batch on
one device.
"""

import logging
import os
import subprocess
import sys
from unittest import mock

import keras
import numpy as np
import pytest
from absl import flags

import tfscale.flags
from tfscale.callbacks import FailAt, InjectedFault
from tfscale.train import TrainConfig, config_from_flags, run, train

RTOL, ATOL = 1e-5, 1e-5
# 2 epochs x 5 steps of 32 digits: a backup every 3 steps, the fault after step 7 (mid-epoch 2).
QUICK = dict(epochs=2, global_batch_size=32, steps_per_epoch=5, verbose=0)
PIPELINE = dict(num_stages=2, num_microbatches=2, data_parallel=2, schedule="gpipe", cpu_replicas=4)


@pytest.fixture(scope="module")
def one_device(data_dir, tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("default"))
    return train(TrainConfig(strategy="default", data_dir=data_dir, model_dir=model_dir, **QUICK)), model_dir


def _weights(model_dir):
    return keras.saving.load_model(os.path.join(model_dir, "model.keras")).get_weights()


def test_flags_become_the_strategy_options():
    fv = flags.FlagValues()
    tfscale.flags.define_all(fv)
    fv(["prog", "--strategy=pipeline", "--num_stages=2", "--num_microbatches=4", "--schedule=gpipe"])
    fv(["prog", "--data_parallel=2", "--cpu_replicas=4", "--global_batch_size=32", "--plan_report"])
    config = config_from_flags(fv)
    assert config.strategy == "pipeline" and config.plan_report
    assert config.strategy_options == {
        "cpu_replicas": 4,
        "num_stages": 2,
        "num_microbatches": 4,
        "schedule": "gpipe",
        "data_parallel": 2,
    }


# 70 s; the fast tier keeps the dp2 x pp2 losses test here and test_backup_and_restore's kill/SIGTERM resumes
@pytest.mark.slow
def test_pipeline_dp2_x_pp2_killed_and_resumed_equals_one_device(one_device, data_dir, tmp_path):
    reference, reference_dir = one_device
    backup, model_dir = str(tmp_path / "backup"), str(tmp_path / "out")
    config = TrainConfig(
        strategy="pipeline",
        strategy_options=PIPELINE,
        data_dir=data_dir,
        backup_dir=backup,
        backup_freq=3,
        model_dir=model_dir,
        **QUICK,
    )
    # The binary's fault is SIGKILL (tests/test_train.py kills the binary); in process it raises.
    with mock.patch("tfscale.train._fail_at_callback", lambda step: FailAt(step, mode="raise")):
        with pytest.raises(InjectedFault):
            train(TrainConfig(**{**vars(config), "fail_at_step": 7}))
    assert os.listdir(backup)
    resumed = train(config)
    assert resumed.resumed_at_step == 6 and resumed.num_replicas == 2
    assert resumed.strategy == "pipeline (PipelineStrategy)"
    np.testing.assert_allclose(resumed.evaluation["test_loss"], reference.evaluation["test_loss"], rtol=RTOL)
    # model.keras holds the merged model: the user's architecture, loadable without tfscale.
    for got, want in zip(_weights(model_dir), _weights(reference_dir), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


@pytest.mark.slow
def test_two_process_pipeline_under_the_launcher_killed_and_resumed_equals_the_uninterrupted_run(
    data_dir, tmp_path
):
    # Uninterrupted: the same DP2 x PP2 in this process, on 4 logical CPUs.
    reference_dir = str(tmp_path / "reference")
    train(
        TrainConfig(
            strategy="pipeline",
            strategy_options=PIPELINE,
            data_dir=data_dir,
            model_dir=reference_dir,
            **QUICK,
        )
    )
    # Two tasks of 2 logical CPUs each: worker 0 trains copy 0 on its CPUs and copy 1 on
    # worker 1's, which only serves them. The client SIGKILLs itself after step 6; the
    # server sees it gone and exits; the launcher restarts both; the backup of step 6 resumes
    # (the fault fires at step 6 exactly, after that backup: the resumed run starts at 7).
    bin_dir = os.path.dirname(sys.executable)
    model_dir, backup = str(tmp_path / "out"), str(tmp_path / "backup")
    command = [
        os.path.join(bin_dir, "tfscale-launch"), "--num_workers=2", "--max_restarts=1", "--",
        os.path.join(bin_dir, "tfscale-train"), "--strategy=pipeline", "--num_stages=2",
        "--num_microbatches=2", "--data_parallel=2", "--schedule=gpipe", "--cpu_replicas=2",
        "--epochs=2", "--global_batch_size=32", "--steps_per_epoch=5", f"--data_dir={data_dir}",
        f"--model_dir={model_dir}", f"--backup_dir={backup}", "--backup_freq=3", "--fail_at_step=6",
    ]  # fmt: skip
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=400, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "job succeeded in attempt 2 of 2" in output, output[-4000:]
    assert "[worker:0] tfscale: resumed from" in output and "global step 6)" in output, output[-4000:]
    assert "[worker:1] train: worker:1 served its devices to the client until it finished" in output
    assert "[worker:1] tfscale-train-result" not in output  # only the client trains and reports
    for got, want in zip(_weights(model_dir), _weights(reference_dir), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


def test_pipeline_dp2_x_pp2_losses_per_epoch_equal_one_device_with_the_plan_report(
    one_device, data_dir, caplog
):
    reference, _ = one_device
    config = TrainConfig(
        strategy="pipeline", strategy_options=PIPELINE, data_dir=data_dir, plan_report=True, **QUICK
    )
    with caplog.at_level(logging.INFO, logger="tfscale"):
        result = train(config)
    # The report profiles a step at start; training is still the one-device training.
    np.testing.assert_allclose(result.history["loss"], reference.history["loss"], rtol=RTOL)
    assert "plan: S=2 M=2 D=2, micro-batch 8 samples" in caplog.text
    # The mlp's stage boundary: 8 samples x 128 floats; 2 x (S-1) x 4096 B x M x D.
    assert "activations 32768 B measured, 32768 B formula" in caplog.text


def test_model_split_dp2_x_tensor_split_2_equals_one_device(one_device, data_dir, tmp_path):
    reference, reference_dir = one_device
    options = dict(num_devices=2, tensor_parallel=True, data_parallel=2, cpu_replicas=4)
    model_dir = str(tmp_path / "out")
    result = train(
        TrainConfig(
            strategy="model_split", strategy_options=options, data_dir=data_dir, model_dir=model_dir, **QUICK
        )
    )
    assert result.strategy == "model_split (ModelSplitStrategy)" and result.num_replicas == 2
    np.testing.assert_allclose(result.history["loss"], reference.history["loss"], rtol=RTOL)
    # Saved merged: the tensor-split layers' shards joined back into the user's Dense layers.
    for got, want in zip(_weights(model_dir), _weights(reference_dir), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--strategy=pipeline", "--num_stages=4", "--data_parallel=2", "--cpu_replicas=4"],
            "--data_parallel=2 x --num_stages=4 needs 8 devices, more than --cpu_replicas=4.",
        ),
        (
            ["--strategy=pipeline", "--data_parallel=3", "--global_batch_size=32"],
            "--global_batch_size=32 is not divisible by --data_parallel=3.",
        ),
        (
            ["--strategy=pipeline", "--data_parallel=2", "--num_microbatches=3", "--global_batch_size=32"],
            "--num_microbatches=3 does not divide the per-replica batch of 16",
        ),
        (
            ["--strategy=model_split", "--num_devices=4", "--data_parallel=2", "--cpu_replicas=4"],
            "--data_parallel=2 x --num_devices=4 needs 8 devices",
        ),
        (["--strategy=mirrored", "--num_stages=2"], "--num_stages applies to --strategy=pipeline"),
        (["--strategy=pipeline", "--num_devices=2"], "--num_devices applies to --strategy=model_split"),
        (["--strategy=pipeline", "--schedule=pipedream"], "--schedule=pipedream: value should be one of"),
        (
            # The schedule's rule (tfscale._strategy_spec), before TensorFlow starts.
            ["--strategy=pipeline", "--schedule=interleaved", "--num_microbatches=3"],
            "--schedule=interleaved: Invalid value for argument `num_microbatches`. Received: "
            "num_microbatches=3 with schedule='interleaved' and num_stages=2. Expected a multiple of",
        ),
        (["--strategy=pipeline", "--data_parallel=0"], "--data_parallel expects a positive integer."),
        (["--strategy=model_split", "--plan_report"], "--plan_report applies to --strategy=pipeline"),
    ],
)
def test_bad_model_parallel_flags_are_one_line_and_exit_2(args, message, capsys):
    assert run(["tfscale-train", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith("tfscale-train: error: ") and message in err
