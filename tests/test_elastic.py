"""Elastic `tfscale-launch --num_workers MIN:MAX`: shrink on a lost worker, grow when it is back.

The semantics tests run the real launcher on a cheap task (`_elastic_task.py`);
one slow test runs real 3-worker `tfscale-train` jobs and checks that a job that
lost a worker and got it back ends at the weights of an uninterrupted run. A
discovery command (`cat FILE`) tells the launcher which slots are usable; the
tests edit FILE. No process the launcher started may be left (`leftovers`).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import keras
import numpy as np
import pytest
from _launch_util import leftovers, read_until, run_launcher, start_launcher

from tfscale.launch import _discovery, elastic
from tfscale.launch.supervisor import LaunchError

HERE = os.path.dirname(os.path.abspath(__file__))
TASK = os.path.join(HERE, "_elastic_task.py")
TRAIN = os.path.join(os.path.dirname(sys.executable), "tfscale-train")
ELASTIC = [
    "--discovery_interval",
    "0.3",
    "--resize_cooldown",
    "0.5",
    "--restart_backoff",
    "0.2",
    "--grace_period",
    "5",
]


def _discovery_file(tmp_path, slots):
    path = tmp_path / "usable"
    path.write_text(f"localhost:{slots}\n")
    return path


def _finish(proc, seen, timeout=300):
    """The whole output; a launcher still running after `timeout` is stopped the way users do (SIGTERM)."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # forwarded to every task, then SIGKILL after --grace_period
        out, _ = proc.communicate(timeout=60)
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
    took = time.monotonic() - start
    assert run.returncode == 1
    assert run.stdout == ""  # no task was started
    last = run.stderr.splitlines()[-1]
    assert re.fullmatch(
        r"tfscale-launch: job failed: 1 usable worker slot, --num_workers 2:3 needs at least 2 "
        r"\(waited (\d+\.\d)s, --elastic_timeout 1\.5s\)",
        last,
    ), last
    assert 1.5 <= float(re.search(r"waited ([\d.]+)s", last).group(1)) <= took  # the wait it made


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
    read_until(proc, "[worker:2] size 3 index 2 restart 0", seen)
    usable.write_text("localhost:2\n")
    go.touch()  # worker 2 fails; its slot is no longer listed
    read_until(proc, "[worker:1] size 2 index 1 restart 1", seen)
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
    # Grown once the larger answer held for --resize_cooldown (0.5 s, two polls at least).
    assert re.search(
        r"elastic: 3 usable worker slots for \d+\.\ds, the job ran on 2: asking every task", output
    )
    assert "elastic: tasks stopped for the resize (worker:0 exit code 75, worker:1 exit code 75)" in output
    assert output.count("[worker:0] backed up") == 2  # stopped after the failure, and for the grow
    assert re.search(
        r"elastic: running from 2 to 3 workers \(3 usable worker slots for [\d.]+s, the job ran on 2\)",
        output,
    )
    configs = [
        json.loads(line.split("TF_CONFIG=", 1)[1]) for line in output.splitlines() if "TF_CONFIG=" in line
    ]
    assert [len(c["cluster"]["worker"]) for c in configs] == [3, 3, 3, 2, 2, 3, 3, 3]
    assert "[worker:2] size 3 index 2 restart 2" in output
    assert "job succeeded in attempt 3 on 3 workers" in output


HOST_TASK = """
import json, os, sys, time
host, size = os.environ["TFSCALE_HOST"], len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
elastic = os.environ["TFSCALE_ELASTIC_WORKERS"], os.environ["TFSCALE_ELASTIC_BATCH"]
print("on", host, "of", size, *elastic, flush=True)
if host == "nodeB":
    sys.exit(3)  # a broken host
if size == 3:
    time.sleep(60)  # stopped when nodeB fails
"""


def test_host_failing_twice_is_cooled_down_and_the_job_goes_on_without_it(marker, tmp_path):
    usable = tmp_path / "usable"
    usable.write_text("nodeA:2\nnodeB:1\n")
    # `env` as the "remote" starter: the tasks run here, started exactly as on another host.
    args = ["--num_workers", "2:3", "--host_discovery", f"cat {usable}",
            "--remote_cmd", "env TFSCALE_HOST={host}", "--max_restarts", "2", "--host_cooldown", "600",
            "--elastic_batch", "per_replica", *ELASTIC,
            "--", sys.executable, "-c", HOST_TASK]  # fmt: skip
    run = run_launcher(args, marker)
    assert run.returncode == 0, run.stderr
    assert run.stdout.count("[worker:2] on nodeB of 3 2:3 per_replica") == 2
    assert "elastic: nodeB failed twice in a row; left out for a cool-down" in run.stderr
    assert '  worker:2 TF_CONFIG={"cluster":{"worker":["nodeA:2222","nodeA:2223","nodeB:2222"]}' in run.stderr
    assert (
        "elastic: running from 3 to 2 workers (worker:2 failed (exit code 3) in attempt 2) on nodeA:2"
        in run.stderr
    )
    assert run.stdout.count("on nodeA of 2 2:3 per_replica") == 2
    assert "job succeeded in attempt 3 on 2 workers" in run.stderr


@pytest.mark.parametrize(
    ("mode", "workers", "batch", "rate"),
    [
        ("global", 2, 48, 0.003),
        ("global", 3, 48, 0.003),
        ("per_replica", 2, 32, 0.002),
        ("per_replica", 3, 48, 0.003),
    ],
)
def test_elastic_batch_rule(mode, workers, batch, rate):
    environ = {elastic.ELASTIC_WORKERS_VAR: "2:3", elastic.ELASTIC_BATCH_VAR: mode}
    rule = elastic.elastic_batch(48, 0.003, num_replicas=workers, num_workers=workers, environ=environ)
    assert (rule.global_batch_size, rule.learning_rate) == (batch, pytest.approx(rate))
    # Two replicas a worker: the full size has 6 replicas, the per-replica batch stays 8.
    rule = elastic.elastic_batch(48, 0.003, num_replicas=2 * workers, num_workers=workers, environ=environ)
    assert rule.global_batch_size == (48 if mode == "global" else 16 * workers)
    assert elastic.elastic_batch(48, 0.003, num_replicas=2, num_workers=2, environ={}) is None
    with pytest.raises(
        LaunchError, match=r"Received: 50 for 3 replicas at the full size. Expected a multiple of 3"
    ):
        elastic.elastic_batch(
            50,
            0.1,
            num_replicas=2,
            num_workers=2,
            environ={**environ, "TFSCALE_ELASTIC_BATCH": "per_replica"},
        )


def test_discovery_lines_and_host_cooldown():
    assert _discovery.parse_hosts("# usable\nnode1:4\n\nnode2\n", "x") == [("node1", 4), ("node2", 1)]
    for bad in ("node1:four", "node1:-1", "node1:\u00b2", "node 1:2", "node1:1234567"):
        with pytest.raises(LaunchError, match=r"Received: '.*'. Expected `host` or `host:slots`"):
            _discovery.parse_hosts(bad, "`--host_discovery`")
    assert _discovery.merge_duplicates([("a", 1), ("b", 2), ("a", 3), ("a", 2)]) == (
        [("a", 3), ("b", 2)],
        ["a"],
    )
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


# --- real tfscale-train jobs ---------------------------------------------------------

EPOCHS, STEPS, BATCH = 4, 1536 // 48, 48  # digits: 1536 training examples, 32 global batches an epoch


def _train(data_dir, model_dir, *extra):
    flags = ["--strategy=multi_worker", "--sharding=data", f"--data_dir={data_dir}", f"--epochs={EPOCHS}"]
    flags += ["--seed=0", "--model=_elastic_model:slow_mlp", f"--model_dir={model_dir}"]
    return [TRAIN, *flags, *extra]


def _pid_of(marker, task_index):
    """The pid of the `tfscale-train` process of worker `task_index` (by its environment)."""
    for pid in leftovers(marker, wait=0):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        task = json.loads(env.get(b"TF_CONFIG", b"{}")).get("task", {})
        if task == {"type": "worker", "index": task_index}:
            return pid
    raise AssertionError(f"no process of worker:{task_index}")


def _model(model_dir):
    import _elastic_model  # noqa: F401  (registers its layer for loading)

    return keras.saving.load_model(os.path.join(model_dir, "model.keras"))


def _global_steps(output, what):
    return [
        int(line.rsplit("global step ", 1)[1].rstrip(")\n")) for line in output.splitlines() if what in line
    ]


def _lose_worker_2_and_get_it_back(marker, tmp_path, train_command, launcher_flags=()):
    """Runs an elastic 2:3 job: kill worker 2 and unlist its slot after step 8, list it again once
    the 2-worker job made a backup. Returns the launcher's output (its lines and the tasks')."""
    usable = _discovery_file(tmp_path, 3)
    args = ["--num_workers", "2:3", "--host_discovery", f"cat {usable}", "--discovery_interval", "1",
            "--max_restarts", "1", "--restart_backoff", "0.5", "--grace_period", "5",
            "--resize_cooldown", "2", *launcher_flags, "--",
            *train_command, "--backup_freq=4", f"--backup_dir={tmp_path / 'backup'}"]  # fmt: skip
    step_sleep = tmp_path / "step_sleep"
    step_sleep.write_text("0.1")
    env = {"PYTHONPATH": HERE, "TFSCALE_TEST_STEP_SLEEP": f"@{step_sleep}"}
    proc = start_launcher(args, marker, env=env, merge_stderr=True)
    seen = []
    try:
        read_until(proc, "(epoch 0, step 8, global step 8)", seen)
        usable.write_text("localhost:2\n")  # the slot of worker 2 is gone...
        os.kill(_pid_of(marker, 2), signal.SIGKILL)  # ...and so is its process
        read_until(proc, "elastic: running from 3 to 2 workers (worker:2 failed (signal SIGKILL)", seen)
        read_until(proc, "[worker:0] tfscale: resumed from", seen)
        read_until(proc, "[worker:0] tfscale: scheduled backup", seen)  # trained on 2 workers
        usable.write_text("localhost:3\n")
        read_until(proc, "elastic: running from 2 to 3 workers", seen)
        step_sleep.write_text("0")  # nothing is left to do while it trains: ~100 steps, 10 s less
    except BaseException:
        proc.terminate()  # forwarded to the tasks: nothing is left behind
        raise
    finally:
        output = _finish(proc, seen, timeout=600)
        (tmp_path / "launcher.log").write_text(output)
    assert proc.returncode == 0, output[-3000:]
    assert "elastic: tasks stopped for the resize (worker:0 exit code 75, worker:1 exit code 75)" in output
    return output


def _attempts(output):
    """The output of each attempt (each starts with the launcher's line about its size)."""
    return output.split("tfscale-launch: elastic: running ")[1:]


def _restored(attempt):
    """`(epoch, step, global step)` worker 0 resumed at in an attempt's output."""
    line = next(x for x in attempt.splitlines() if x.startswith("[worker:0] tfscale: resumed from"))
    epoch, step, global_step = re.search(r"epoch (\d+), step (\d+); global step (\d+)\)", line).groups()
    return int(epoch), int(step), int(global_step)


@pytest.mark.slow
def test_tfscale_train_loses_a_worker_goes_on_with_2_grows_back_to_3_and_ends_at_the_uninterrupted_weights(
    marker, data_dir, tmp_path
):
    reference = tmp_path / "reference"
    run = run_launcher(
        ["--num_workers", "3", "--", *_train(data_dir, reference, f"--global_batch_size={BATCH}")],
        marker, env={"PYTHONPATH": HERE}, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    model_dir = tmp_path / "elastic"
    output = _lose_worker_2_and_get_it_back(
        marker, tmp_path, _train(data_dir, model_dir, f"--global_batch_size={BATCH}")
    )
    # The timeline of global steps: each attempt resumed at the newest backup of the one before,
    # and every attempt trained on the same global batches (48 examples a step, 32 steps an epoch).
    first, second, third = _attempts(output)
    assert "global_batch=48 steps/epoch=32" in second and "workers=2" in second
    assert _restored(second)[2] == max(_global_steps(first, " backup /")) >= 8
    assert _restored(third)[2] == max(_global_steps(second, " backup /")) > _restored(second)[2]
    final = _model(model_dir)
    assert int(final.optimizer.iterations.numpy()) == EPOCHS * STEPS
    pairs = list(zip(final.get_weights(), _model(reference).get_weights()))
    print(f"max |elastic - uninterrupted| = {max(float(np.max(np.abs(a - b))) for a, b in pairs):.3g}")
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_per_replica_batch_scales_the_global_batch_and_learning_rate_with_the_workers(
    marker, data_dir, tmp_path
):
    model_dir = tmp_path / "elastic"
    command = _train(data_dir, model_dir, "--global_batch_size=48", "--learning_rate=0.003")
    output = _lose_worker_2_and_get_it_back(marker, tmp_path, command, ["--elastic_batch=per_replica"])
    first, second, third = _attempts(output)
    rule = "elastic (2:3 workers, --elastic_batch=per_replica): {} of 3 replicas, per-replica batch 16, "
    for attempt, workers, batch, rate in (
        (first, 3, 48, 0.003),
        (second, 2, 32, 0.002),
        (third, 3, 48, 0.003),
    ):
        assert (
            f"[worker:0] {rule.format(workers)}global batch {batch}, learning rate {rate:g} (x {workers}/3)"
            in (attempt)
        )
        assert f"global_batch={batch} steps/epoch={1536 // batch}" in attempt
    # A resume converts the position: the examples done of the epoch, in batches of the new size.
    for attempt, old, new in ((second, 48, 32), (third, 32, 48)):
        epoch, step, global_step = _restored(attempt)
        done = next(x for x in attempt.splitlines() if "[worker:0] tfscale: elastic resume" in x)
        examples, of_epoch = map(int, re.search(r"example (\d+) of epoch (\d+)", done).groups())
        assert f"steps of {old}) is step {examples // new} of {new} here" in done
        # The same place in the data: a backup at the last step of an epoch resumes as the next
        # epoch's step 0 (the kill's timing decides which one a run gets).
        assert of_epoch * 1536 + (examples // new) * new == epoch * 1536 + step * new
        before, after = 0.003 * old / 48, 0.003 * new / 48  # the rate of each size, by the rule
        assert (
            f"elastic resume: learning rate {before:g} -> {after:g} (x {new}/{old}, global batch)" in attempt
        )
    # Steps: every step done so far, then the rest of the epoch and the epochs left at 48 a step.
    epoch, step, global_step = _restored(third)
    final = _model(model_dir)
    assert int(final.optimizer.iterations.numpy()) == global_step + (32 - step) + 32 * (EPOCHS - 1 - epoch)
    assert float(final.optimizer.learning_rate.numpy()) == pytest.approx(0.003)
