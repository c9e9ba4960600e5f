"""tfscale-train end to end (subprocesses and local clusters), its callbacks and models."""

import glob
import json
import os
import re
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale import models
from tfscale.callbacks import LearningRateWarmup, StepTimer
from tfscale.launch import run_local_cluster
from tfscale.train import RESULT_PREFIX, TrainConfig, train

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_profile_steps_works_with_strategies_that_place_their_own_devices": 1,
}

QUICK = ("--epochs=3", "--global_batch_size=64", "--seed=0")
CHILD_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}


@pytest.fixture(scope="module")
def one_device(data_dir, tmp_path_factory):
    """The reference: the QUICK flags on one device, in this process."""
    model_dir = str(tmp_path_factory.mktemp("one_device"))
    config = TrainConfig(
        strategy="one_device",
        epochs=3,
        global_batch_size=64,
        data_dir=data_dir,
        model_dir=model_dir,
        verbose=0,
    )
    return train(config)


def _results(text):
    return [
        json.loads(line[len(RESULT_PREFIX) :]) for line in text.splitlines() if line.startswith(RESULT_PREFIX)
    ]


def _assert_same_metrics(result, reference):
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(result["history"][key], reference.history[key], rtol=1e-4, atol=1e-6)
    assert result["evaluation"].keys() == reference.evaluation.keys()
    for key, value in reference.evaluation.items():
        np.testing.assert_allclose(result["evaluation"][key], value, rtol=1e-4, atol=1e-6)


def _weights(model_dir):
    return keras.saving.load_model(os.path.join(model_dir, "model.keras")).get_weights()


def _train_cli(*args, env=None, cwd=None, timeout=240):
    return subprocess.run(
        [sys.executable, "-m", "tfscale.train", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, **CHILD_ENV, **(env or {})),
        cwd=cwd,
        timeout=timeout,
        check=False,
    )


def test_no_flags_trains_the_bundled_digits_far_above_chance(data_dir, tmp_path):
    start = time.monotonic()
    proc = _train_cli(env={"TFSCALE_DATA_DIR": data_dir}, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = _results(proc.stdout)
    assert result["strategy"] == "auto (OneDeviceStrategy)" and result["num_replicas"] == 1
    assert result["history"]["accuracy"][-1] > 0.97  # chance: 0.1
    assert result["evaluation"]["test_accuracy"] > 0.85  # 261 digits by writers unseen in training
    assert result["examples_per_sec"] > 0
    assert "final train loss=" in proc.stdout and "examples/s" in proc.stdout
    assert os.listdir(tmp_path) == []  # no --model_dir: nothing written
    assert time.monotonic() - start < 180


def test_mirrored_matches_one_device_with_the_same_global_batch(one_device, data_dir):
    config = TrainConfig(
        strategy="mirrored",
        strategy_options={"cpu_replicas": 2},
        epochs=3,
        global_batch_size=64,
        data_dir=data_dir,
        verbose=0,
    )
    result = train(config)
    assert result.num_replicas == 2 and result.sharding == "none"
    _assert_same_metrics(json.loads(result.to_json()), one_device)


@pytest.mark.slow  # 11 s, two binary runs; fast tier: test_communication's compressed training
def test_gradient_compression_flag_trains_within_one_percent_of_uncompressed(one_device, data_dir):
    args = ("--strategy=mirrored", "--cpu_replicas=2", "--gradient_compression=fp16", "--bytes_per_pack=4096")
    proc = _train_cli(*QUICK, *args, f"--data_dir={data_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = _results(proc.stdout)
    loss, want = result["history"]["loss"][-1], one_device.history["loss"][-1]
    assert abs(loss - want) < 0.01 * want


@pytest.fixture(scope="module")
def multi_worker(data_dir, tmp_path_factory):
    """The QUICK flags as a 2-worker cluster, the binary in each process (profiled, steps 4-6)."""
    model_dir = str(tmp_path_factory.mktemp("multi_worker"))
    command = [sys.executable, "-m", "tfscale.train", *QUICK, "--strategy=multi_worker"]
    command += [f"--data_dir={data_dir}", f"--model_dir={model_dir}", "--profile_steps=4:6"]
    tasks = run_local_cluster(command, 2, env=CHILD_ENV, timeout=300, check=False, failure_grace=10)
    assert all(t.ok for t in tasks), "\n".join(t.log[-3000:] for t in tasks)
    return [_results(t.log)[0] for t in tasks], model_dir


@pytest.mark.slow
def test_multi_worker_matches_one_device_and_only_the_chief_writes(multi_worker, one_device):
    (w0, w1), model_dir = multi_worker
    assert (w0["num_workers"], w0["num_replicas"], w0["sharding"]) == (2, 2, "data")
    # Both workers log the same, cluster-wide metrics: Keras (with tfscale.compat) averages them.
    assert w0["history"]["loss"] == w1["history"]["loss"] and w0["evaluation"] == w1["evaluation"]
    _assert_same_metrics(w0, one_device)
    assert (w0["is_chief"], w1["is_chief"]) == (True, False) and w1["model_path"] is None
    # profile/: --profile_steps, where every worker writes its own (task-named) files.
    assert sorted(os.listdir(model_dir)) == ["logs", "model.keras", "profile", "summary.json"]
    with open(os.path.join(model_dir, "summary.json")) as f:
        assert json.load(f)["task"] == "worker:0"
    for got, want in zip(_weights(model_dir), _weights(one_device.model_path.rsplit("/", 1)[0])):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_profile_steps_flag_traces_the_chief_times_every_worker_and_the_chief_draws_them(multi_worker):
    profile = os.path.join(multi_worker[1], "profile")
    reports = {}
    for task in ("worker-0", "worker-1"):
        with open(os.path.join(profile, f"communication-{task}.json")) as f:
            reports[task] = report = json.load(f)
        assert report["profiled_steps"] == [4, 6] and 0 < report["step_s"] < 60
        assert report["allreduce_bytes_per_step"] > 0 and report["replicas_in_sync"] == 2
    chief, worker = reports["worker-0"], reports["worker-1"]
    assert chief["traced"] and len(chief["steps"]) == 3
    assert chief["allreduce_launches_per_step"] >= 1 and chief["allreduce_s_per_step"] > 0
    assert os.path.getsize(os.path.join(profile, "trace-worker-0.json.gz")) > 0
    # Worker 1 is no collective leader: TF 2.21's profiler stop could crash it (compat/tf_traceme_split).
    assert not worker["traced"] and worker["steps"] == [] and worker["allreduce_s_per_step"] is None
    assert sorted(os.listdir(profile)) == [
        "communication-worker-0.json",
        "communication-worker-1.json",
        "communication.png",
        "trace-worker-0.json.gz",
        "worker-0",
    ]
    with open(os.path.join(profile, "communication.png"), "rb") as f:
        assert f.read(4) == b"\x89PNG"


@pytest.mark.slow
def test_kill_and_resume_through_the_launcher_ends_with_the_uninterrupted_weights(
    multi_worker, data_dir, tmp_path
):
    _, reference_dir = multi_worker
    model_dir, backup_dir = str(tmp_path / "model"), str(tmp_path / "backup")
    command = [
        sys.executable,
        "-m",
        "tfscale.train",
        *QUICK,
        "--strategy=multi_worker",
        f"--data_dir={data_dir}",
    ]
    # Backups written in the background with at most 10 steps at risk; every task SIGKILLs
    # itself after global step 40 (epoch 2, step 16).
    command += [
        f"--model_dir={model_dir}",
        f"--backup_dir={backup_dir}",
        "--backup_freq=10",
        "--backup_async",
        "--fail_at_step=40",
    ]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfscale.launch.launcher",
            "--num_workers=2",
            "--max_restarts=1",
            "--",
            *command,
        ],
        capture_output=True,
        text=True,
        env=dict(os.environ, **CHILD_ENV),
        timeout=400,
        check=False,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    output = proc.stdout + proc.stderr
    resumed = re.findall(r"tfscale: resumed from ckpt-\d+ \(epoch \d+, step \d+; global step (\d+)\)", output)
    # Async snapshots come early (every worker at the same step), so that the kill loses at most 10.
    assert len(resumed) == 2 and resumed[0] == resumed[1] and 30 <= int(resumed[0]) <= 40, output[-4000:]
    for got, want in zip(_weights(model_dir), _weights(reference_dir)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.slow  # 2 binary runs; fast tier: test_zero's in-process kill-and-resume cases
def test_zero_job_sigkilled_then_resumed_on_more_replicas_ends_with_the_one_device_weights(
    one_device, data_dir, tmp_path
):
    # ZeRO-1 on 2 replicas SIGKILLs itself after global step 13 (backups every 5); the restart
    # runs on 4 replicas, so each optimizer slot is cut into 4 shards instead of 2 on load.
    model_dir, backup_dir = str(tmp_path / "model"), str(tmp_path / "backup")
    args = [*QUICK, "--strategy=mirrored", "--zero_stage=1", f"--data_dir={data_dir}"]
    args += [f"--model_dir={model_dir}", f"--backup_dir={backup_dir}", "--backup_freq=5"]
    killed = _train_cli(*args, "--cpu_replicas=2", "--fail_at_step=13")
    assert killed.returncode == -9, (killed.stdout + killed.stderr)[-3000:]
    resumed = _train_cli(*args, "--cpu_replicas=4")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "(epoch 0, step 10; global step 10)" in resumed.stdout + resumed.stderr
    for got, want in zip(_weights(model_dir), _weights(one_device.model_path.rsplit("/", 1)[0]), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategy=horovod"], "--strategy=horovod: value should be one of"),
        (
            ["--strategy=mirrored", "--cpu_replicas=2", "--global_batch_size=63"],
            "63 is not divisible by the 2",
        ),
        (["--dataset=imagenet"], "--dataset='imagenet' is unknown"),
        (["--data_dir=/nonexistent/tfds"], "--data_dir='/nonexistent/tfds' does not exist"),
        (["--model=resnet"], "--model='resnet' is unknown"),
        (["--undefined_flag=1"], "Unknown command line flag 'undefined_flag'"),
        (["--profile_steps=5:2"], "--profile_steps='5:2'. Expected A:B"),
    ],
)
def test_flag_errors_are_one_line_and_a_nonzero_exit(args, message, tmp_path):
    proc = _train_cli(*args, f"--model_dir={tmp_path / 'out'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("tfscale-train: error: ") and message in proc.stderr
    assert not (tmp_path / "out").exists()


def test_errors_found_after_tensorflow_starts_end_with_one_error_line(tmp_path):
    # An unprepared TFDS dataset is only found once TensorFlow runs; TF may print its own
    # start-up lines first, but tfscale's message is one line and there is no traceback.
    proc = _train_cli("--dataset=tfds:mnist", f"--data_dir={tmp_path}", f"--model_dir={tmp_path / 'out'}")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tfscale-train: error: Dataset `tfds:mnist` is not prepared")
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_a_fully_torn_backup_dir_ends_the_binary_with_one_line_not_a_traceback(data_dir, tmp_path):
    # UnusableBackupError (an OSError too) is a tfscale.Error, so tfscale-train reports it.
    torn = tmp_path / "backup" / "ckpt-000000000010"
    torn.mkdir(parents=True)
    (torn / "manifest.json").write_text('{"files": {"state.npz": {"size": 1, "sha256": "0"}}}')
    (torn / "state.npz").write_bytes(b"torn")
    proc = _train_cli("--epochs=1", f"--data_dir={data_dir}", f"--backup_dir={tmp_path / 'backup'}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tfscale-train: error: No usable backup in `backup_dir=")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # 14 s; fast tier: test_linear_scaling_with_warmup_reaches_lr_times_replicas
def test_learning_rate_warmup_follows_the_linear_scaling_rule():
    warmup = LearningRateWarmup(0.1, warmup_epochs=1, steps_per_epoch=4, scale=2)
    seen = []
    recorder = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda b, logs: seen.append(float(warmup.model.optimizer.learning_rate))
    )
    model = models.mlp((3,), 2)
    model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = np.ones((24, 3), "float32"), np.zeros(24, "int64")
    model.fit(x, y, batch_size=4, epochs=1, callbacks=[warmup, recorder], verbose=0, shuffle=False)
    # Goyal et al.: from lr to lr x 2 over 4 steps, then flat.
    np.testing.assert_allclose(seen, [0.125, 0.15, 0.175, 0.2, 0.2, 0.2], rtol=1e-6)
    model.optimizer.iterations.assign(2)  # a resumed run continues the ramp
    seen.clear()
    model.fit(x[:4], y[:4], batch_size=4, epochs=1, callbacks=[warmup, recorder], verbose=0)
    np.testing.assert_allclose(seen, [0.175], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(learning_rate=0), r"`learning_rate`\. Received: learning_rate=0"),
        (dict(warmup_epochs=-1), r"`warmup_epochs`\. Received: warmup_epochs=-1"),
        (dict(steps_per_epoch=0), r"`steps_per_epoch`\. Received: steps_per_epoch=0"),
    ],
)
def test_learning_rate_warmup_rejects_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LearningRateWarmup(**{"learning_rate": 0.1, "warmup_epochs": 1, "steps_per_epoch": 10, **kwargs})


def test_step_timer_reports_throughput_to_logs_and_tensorboard(tmp_path):
    import tfscale.strategies

    strategy = tfscale.strategies.get("mirrored", cpu_replicas=2)
    with strategy.scope():
        model = models.mlp((8,), 2)
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    ds = tf.data.Dataset.from_tensor_slices((np.ones((512, 8), "float32"), np.zeros(512, "int64"))).batch(32)
    timer = StepTimer(32, num_replicas=2)
    start = time.perf_counter()
    history = model.fit(
        ds, epochs=2, callbacks=[timer, keras.callbacks.TensorBoard(str(tmp_path))], verbose=0, shuffle=False
    )
    wall = time.perf_counter() - start
    rates, per_replica = history.history["examples_per_sec"], history.history["examples_per_sec_per_replica"]
    np.testing.assert_allclose(per_replica, np.array(rates) / 2)
    # The timer leaves out each epoch's first step, so it can only be faster than wall-clock.
    assert timer.throughput >= 2 * (16 - 1) * 32 / wall
    tags = set()
    for path in glob.glob(str(tmp_path / "train" / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags |= {v.tag for v in event.summary.value}
    assert "epoch_examples_per_sec" in tags


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_registry_models_give_float32_logits_under_mixed_precision(name):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = models.build(name, (8, 8, 1), 10)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model(np.zeros((2, 8, 8, 1), "float32")).dtype == "float32"
    assert model.output_shape == (None, 10)


def test_user_model_factory_by_module_path():
    model = models.build("tfscale.models:mlp", (4,), 3)
    assert model.name == "mlp"
    with pytest.raises(models.ModelError, match=r"Cannot load model factory\. Received: model='nosuch:fn'"):
        models.build("nosuch:fn", (4,), 3)


def test_linear_scaling_with_warmup_reaches_lr_times_replicas(data_dir):
    config = TrainConfig(
        strategy="mirrored",
        strategy_options={"cpu_replicas": 2},
        epochs=2,
        global_batch_size=64,
        learning_rate=0.01,
        optimizer="sgd",
        lr_scaling="linear",
        lr_warmup_epochs=2,
        data_dir=data_dir,
        verbose=0,
    )
    history = train(config).history
    # Ramp over 2 x 24 steps from 0.01 to 0.02: halfway (+24/48) after epoch 1, full after epoch 2.
    np.testing.assert_allclose(history["learning_rate"], [0.01 + 0.01 * 24 / 48, 0.02], rtol=1e-5)


@pytest.mark.parametrize(
    "strategy, options",
    [("default", {}), ("pipeline", {}), ("model_split", {"num_devices": 2})],
)
def test_profile_steps_works_with_strategies_that_place_their_own_devices(
    strategy, options, data_dir, tmp_path
):
    # The default strategy (and the model-parallel models on it) has no `worker_devices`:
    # `--strategy=pipeline --profile_steps=2:3` ended in a traceback (issue 32).
    config = TrainConfig(
        strategy=strategy,
        strategy_options=options,
        epochs=1,
        steps_per_epoch=3,
        data_dir=data_dir,
        model_dir=str(tmp_path),
        profile_steps="2:3",
        verbose=0,
    )
    train(config)
    with open(tmp_path / "profile" / "communication-local.json") as f:
        report = json.load(f)
    assert report["profiled_steps"] == [2, 3] and report["allreduce_launches_per_step"] == 0


# Lines that say nothing about the job: TensorFlow's start-up lines, Keras's and TFDS's
# notices for things tfscale itself does, setuptools' banner. None may reach the user.
NOISE = (
    "All log messages before absl::InitializeLog",
    "oneDNN custom operations",
    "Could not find cuda drivers",
    "failed call to cuInit",
    "`shuffle=True` was passed",
    "Downloading and preparing dataset",
    "Generating splits",
    "Package would be ignored",
    "Using CollectiveAllReduceStrategy eagerly",
)
TRAIN_BIN = os.path.join(os.path.dirname(sys.executable), "tfscale-train")


@pytest.mark.slow
def test_killed_then_resumed_run_is_quiet_and_says_what_ran(tmp_path):
    # As a user runs it: fresh data dir (the bundled dataset gets prepared), no TF_CPP_* set.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPP")}
    env["TFSCALE_DATA_DIR"] = str(tmp_path / "tfds")
    argv = [TRAIN_BIN, "--epochs=2", f"--backup_dir={tmp_path / 'backup'}", "--backup_freq=10"]
    runs = [
        subprocess.run([*argv, "--fail_at_step=30"], capture_output=True, env=env, timeout=300, check=False),
        subprocess.run(argv, capture_output=True, env=env, timeout=300, check=False),
    ]
    assert runs[0].returncode == -9 and runs[1].returncode == 0, runs[1].stderr[-2000:]
    for run in runs:
        out = (run.stdout + run.stderr).decode()
        assert not [line for line in out.splitlines() if any(n in line for n in NOISE)], out[-3000:]
        assert "\r" not in out and "\b" not in out, repr(out[-1000:])
    resumed = runs[1].stdout.decode()
    assert "tfscale: resumed from ckpt-000000000030 (epoch 1, step 6; global step 30)" in resumed
    assert "resumed at step 30 of 48: trained the remaining 18 steps in " in resumed, resumed
    assert "trained 2 epochs" not in resumed


@pytest.mark.slow
def test_under_the_launcher_each_task_prints_prefixed_progress_lines(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TF_CPP")}
    env["TFSCALE_DATA_DIR"] = str(tmp_path / "tfds")  # prepared here: TFDS would draw progress bars
    launcher = os.path.join(os.path.dirname(sys.executable), "tfscale-launch")
    run = subprocess.run(
        [launcher, "--num_workers", "2", "--", TRAIN_BIN, "--epochs=1"],
        capture_output=True,
        env=env,
        timeout=400,
        check=False,
    )
    out = (run.stdout + run.stderr).decode()
    assert run.returncode == 0, out[-3000:]
    assert "\r" not in out and "\b" not in out, repr(out[-1000:])
    assert not [line for line in out.splitlines() if any(n in line for n in NOISE)], out[-3000:]
    # Keras's epoch line (verbose=2: steps, time, loss, examples/s) from the chief only.
    progress = [line for line in out.splitlines() if line.startswith("[worker:0] 24/24 - ")]
    assert len(progress) == 1 and "loss:" in progress[0] and "examples_per_sec:" in progress[0], out
    assert not [line for line in out.splitlines() if line.startswith("[worker:1] 24/24")]
