"""`tfscale-launch` with real TensorFlow clusters: the tutorial, SIGKILL + resume, two network namespaces.

Each test starts real multi-worker Keras 3 `fit` jobs through the launcher binary
and checks the weights every worker wrote; afterwards no process the launcher
started may be left (`leftovers`). The tutorial run also fits `_global_batch_probe`
on the tutorial's own strategy and compares it with plain Keras on one device.
"""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
from _launch_util import read_until, run_launcher, start_launcher

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "_launch_train.py")
TUTORIAL_RUNNER = os.path.join(HERE, "_launch_tutorial.py")
TUTORIAL = os.path.join(os.path.dirname(HERE), "examples", "multi_worker_tutorial", "main.py")

pytestmark = pytest.mark.slow


def _weights(out_dir, names):
    loaded = {}
    for name in names:
        with np.load(os.path.join(out_dir, f"{name}.npz")) as f:
            loaded[name] = [f[k] for k in f.files]
    return loaded


def _assert_identical(weights):
    names = list(weights)
    for name in names[1:]:
        for a, b in zip(weights[names[0]], weights[name]):
            np.testing.assert_array_equal(a, b, err_msg=f"{name} differs from {names[0]}")


def _one_device_probe():
    import _global_batch_probe
    import tensorflow as tf

    return _global_batch_probe.train(tf.distribute.get_strategy())


def test_tutorial_main_runs_unchanged_on_2_workers_with_keras_compat(marker, tmp_path):
    """The tutorial fits unchanged; so does a masked, uneven, clipped fit on its strategy, with
    the one-device numbers: `--keras_compat` applies the loss-denominator and optimizer fixes
    too (stock Keras: weights ~0.04 off), not only the multi-worker one."""
    run = run_launcher(
        [
            "--num_workers",
            "2",
            "--keras_compat",
            "--",
            sys.executable,
            TUTORIAL_RUNNER,
            TUTORIAL,
            str(tmp_path),
        ],
        marker,
        timeout=600,
        cwd=str(tmp_path),
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.stdout.count("keras fixes applied: True") == 2
    assert run.stdout.count("Epoch 3/3") == 2
    weights = _weights(tmp_path, ["worker-0", "worker-1"])
    _assert_identical(weights)
    assert (
        sum(w.size for w in weights["worker-0"]) == 32 * 9 + 32 + 21632 * 128 + 128 + 1290
    )  # the tutorial CNN
    want_weights, want_losses = _one_device_probe()
    for name in ("worker-0", "worker-1"):
        with np.load(tmp_path / f"{name}-probe.npz") as f:
            got_weights, got_losses = [f[k] for k in f.files if k != "loss"], f["loss"]
        off = max(float(np.max(np.abs(g - w))) for g, w in zip(got_weights, want_weights))
        assert off <= 1e-5, f"{name}: weights {off:.3g} off plain Keras on one device"
        np.testing.assert_allclose(got_losses, want_losses, rtol=1e-5, err_msg=name)
    assert run.stdout.count("global-batch fixes applied: [True, True]") == 2


def test_sigkilled_worker_is_restarted_and_resumes_to_the_uninterrupted_weights(marker, tmp_path):
    names = ["worker-0", "worker-1", "worker-2"]
    common = ["--num_workers", "3", "--grace_period", "2", "--restart_backoff", "0.5"]
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    reference.mkdir()
    faulty.mkdir()
    run = run_launcher(
        [*common, "--", sys.executable, TRAIN, "--out", str(reference), "--backup_dir", str(tmp_path / "b1")],
        marker,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    expected = _weights(reference, names)
    _assert_identical(expected)

    run = run_launcher(
        [*common, "--max_restarts", "2", "--", sys.executable, TRAIN, "--out", str(faulty),
         "--backup_dir", str(tmp_path / "b2"), "--fail_step", "16", "--fail_task", "worker:1"],
        marker,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert "worker:1 failed (signal SIGKILL) in attempt 1; restarting the job (restart 1 of 2)" in run.stderr
    assert "job succeeded in attempt 2 of 3" in run.stderr
    # Attempt 2 resumed from the backup at step 16: it ran steps 17..36 only.
    attempt_2 = run.stdout.split("[worker:0] first-step-at")[2]
    assert "[worker:0] step 17\n" in attempt_2 and "[worker:0] step 16\n" not in attempt_2
    got = _weights(faulty, names)
    _assert_identical(got)
    for a, b in zip(expected["worker-0"], got["worker-0"]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class _Namespaces:
    """Two network namespaces joined by one veth pair, 10.213.<n>.1 and .2 on a /30."""

    def __init__(self):
        tag = os.getpid() % 10000
        self.names = [f"tfsl{tag}h0", f"tfsl{tag}h1"]
        self.addresses = [f"10.213.{tag % 250}.1", f"10.213.{tag % 250}.2"]
        self.links = [f"tfsl{tag}v0", f"tfsl{tag}v1"]

    def create(self):
        for name in self.names:
            _ip("netns", "add", name)
        _ip("link", "add", self.links[0], "netns", self.names[0], "type", "veth",
            "peer", "name", self.links[1], "netns", self.names[1])  # fmt: skip
        for name, link, address in zip(self.names, self.links, self.addresses):
            _ip("-n", name, "addr", "add", f"{address}/30", "dev", link)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", link, "up")

    def set_link(self, host, state):
        _ip("-n", self.names[host], "link", "set", self.links[host], state)

    def remove(self):
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


def _ip(*args):
    subprocess.run(["ip", *args], capture_output=True, check=True, text=True)


@pytest.fixture
def namespaces():
    spaces = _Namespaces()
    try:
        spaces.create()
    except (OSError, subprocess.CalledProcessError) as e:
        spaces.remove()
        detail = str(getattr(e, "stderr", "") or e).strip()
        message = f"cannot create network namespaces here (needs root and `ip netns`): {detail}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI must run this test (.ci/run installs iproute2)")
        pytest.skip(message)
    yield spaces
    spaces.remove()


def test_two_host_job_in_network_namespaces_fails_fast_on_a_cut_link_and_restarts(
    marker, namespaces, tmp_path
):
    remote = f"ip netns exec {namespaces.names[0][:-1]}{{host_index}}"
    args = [
        "--hosts", ",".join(namespaces.addresses), "--remote_cmd", remote, "--heartbeat_timeout", "30",
        "--max_restarts", "1", "--restart_backoff", "3", "--grace_period", "2",
        "--", sys.executable, TRAIN, "--out", str(tmp_path), "--epochs", "2", "--step_sleep", "0.2",
    ]  # fmt: skip
    proc = start_launcher(args, marker, merge_stderr=True)  # launcher and task lines in order
    seen = []
    try:
        read_until(proc, "[worker:1] step 3", seen, timeout=240)
        namespaces.set_link(1, "down")
        cut = time.monotonic()
        restart = read_until(proc, "restarting the job (restart 1 of 1)", seen, timeout=120)
        detected = time.monotonic() - cut
        print(f"after {detected:.1f}s: {restart}")  # which rule caught it (heartbeat or a task error)
        namespaces.set_link(1, "up")
        assert proc.wait(timeout=300) == 0, "".join(seen[-40:]) + proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert detected < 30 + 2 + 15, f"the cut link took {detected:.0f}s to fail the job"
    assert "in attempt 1" in restart
    weights = _weights(tmp_path, ["worker-0", "worker-1"])
    _assert_identical(weights)
