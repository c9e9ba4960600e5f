"""`tfscale-launch`: TF_CONFIG per task, output, failure semantics, restarts, signals, no orphans.

Semantics tests run the real binary on cheap `sh`/`python -c` commands; the
tests that start TensorFlow clusters are in `test_launch_training.py`. Every test
passes a marker variable to the launcher and checks afterwards that no process
carrying it is left (`leftovers`).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from unittest import mock

import pytest
import tensorflow as tf
from _launch_util import LAUNCHER, _env, run_launcher, start_launcher

from tfscale._quiet import is_startup_noise
from tfscale.cluster import ClusterSpec
from tfscale.launch import _procs, _remote, jobs
from tfscale.launch.supervisor import LaunchError

PRINT_ENV = "import os, json; print(json.dumps(dict(os.environ)))"


def _lines(stdout, prefix):
    return [line[len(prefix) + 3 :] for line in stdout.splitlines() if line.startswith(f"[{prefix}] ")]


def test_each_task_gets_its_tf_config_and_nothing_else_changes(marker, tmp_path):
    # The evaluator is a sidecar, stopped once chief and workers are done: every task waits
    # (bounded) until all four have printed, so a slow evaluator start cannot lose its line.
    printed = tmp_path / "printed"
    printed.mkdir()
    wait_for_all = (
        f"; import time; open(os.path.join({str(printed)!r}, str(os.getpid())), 'w').close()"
        "; deadline = time.monotonic() + 60"
        f"\nwhile len(os.listdir({str(printed)!r})) < 4 and time.monotonic() < deadline: time.sleep(0.01)"
    )
    command = [sys.executable, "-c", PRINT_ENV + wait_for_all]
    run = run_launcher(["--num_workers", "2", "--chief", "--evaluator", "--", *command], marker)
    assert run.returncode == 0, run.stderr
    launcher_env = dict(
        os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", TFSCALE_LAUNCH_TEST_MARKER=marker
    )
    clusters, job_ids = set(), set()
    for name in ["chief:0", "worker:0", "worker:1", "evaluator:0"]:
        (line,) = _lines(run.stdout, name)
        env = json.loads(line)
        tf_config = env.pop("TF_CONFIG")
        assert env.pop("TFSCALE_RESTART_COUNT") == "0"
        job_ids.add(env.pop("TFSCALE_JOB_ID"))  # the job's identity for its backups: one per job
        assert env == launcher_env
        # TensorFlow's own resolver reads the task and cluster we meant.
        with mock.patch.dict(os.environ, {"TF_CONFIG": tf_config}):
            resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
            assert (resolver.task_type, resolver.task_id) == (name.split(":")[0], int(name.split(":")[1]))
            cluster = resolver.cluster_spec().as_dict()
        clusters.add(json.dumps(cluster, sort_keys=True))
    (cluster,) = [json.loads(c) for c in clusters]
    (job_id,) = job_ids
    assert job_id.startswith("launch-")
    addresses = [a for kind in ("chief", "worker", "evaluator") for a in cluster[kind]]
    assert len(addresses) == 4 and len(set(addresses)) == 4
    assert all(a.startswith("127.0.0.1:") for a in addresses)


def test_output_is_prefixed_line_by_line(marker):
    script = "for i in 1 2 3; do printf 'line %s of ' $i; sleep 0.01; echo $TFSCALE_WHO; done; printf tail"
    run = run_launcher(["--num_workers", "3", "--", "sh", "-c", script], marker, env={"TFSCALE_WHO": "me"})
    assert run.returncode == 0, run.stderr
    for i in range(3):
        assert _lines(run.stdout, f"worker:{i}") == ["line 1 of me", "line 2 of me", "line 3 of me", "tail"]
    assert all(line.startswith("[worker:") for line in run.stdout.splitlines())


def test_log_dir_gets_one_file_per_task_appended_on_restart(marker, tmp_path):
    log_dir = tmp_path / "logs"
    count = tmp_path / "count"
    # Both tasks print before either fails (a failing peer stops the other at once), and the
    # first attempt fails, the second succeeds, whatever the order the tasks run in.
    script = (
        f'echo "task $TFSCALE_N"; echo x >> {count}; i=0; '
        f"while [ $(wc -l < {count}) -lt 2 ] && [ $i -lt 3000 ]; do sleep 0.02; i=$((i+1)); done; "
        '[ "$TFSCALE_RESTART_COUNT" != 0 ]'
    )
    run = run_launcher(
        ["--num_workers", "2", "--max_restarts", "1", "--restart_backoff", "0", "--log_dir", str(log_dir),
         "--", "sh", "-c", script],
        marker,
        env={"TFSCALE_N": "7"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert sorted(os.listdir(log_dir)) == ["worker-0.log", "worker-1.log"]
    text = (log_dir / "worker-1.log").read_text()
    assert text.count("task 7") == 2
    assert "attempt 1 of 2" in text and "attempt 2 of 2" in text


@pytest.mark.parametrize(
    ("command", "reason"),
    [("exit 3", "exit code 3"), ("kill -KILL $$", "signal SIGKILL")],
    ids=["exit_code", "sigkill"],
)
def test_failed_task_stops_the_others_and_fails_fast(marker, command, reason):
    script = f'case "$TF_CONFIG" in *\\"index\\":1*) sleep 0.2; {command};; esac; exec sleep 60'
    started = time.monotonic()
    run = run_launcher(["--num_workers", "3", "--max_restarts", "0", "--", "sh", "-c", script], marker)
    assert time.monotonic() - started < 15
    assert run.returncode == 1
    assert (
        f"job failed: worker:1 failed ({reason}) in attempt 1; no restarts left (--max_restarts=0"
        in run.stderr
    )


def test_restarts_until_the_job_succeeds(marker, tmp_path):
    count = tmp_path / "count"
    # Each attempt appends one line per task; attempts 1 and 2 fail in worker:0.
    script = (
        f"echo x >> {count}; sleep 0.1; n=$(wc -l < {count}); "
        '[ $n -gt 4 ] || case "$TF_CONFIG" in *\\"index\\":0*) exit 1;; esac'
    )
    run = run_launcher(
        ["--num_workers", "2", "--max_restarts", "3", "--restart_backoff", "0.1", "--", "sh", "-c", script],
        marker,
    )
    assert run.returncode == 0, run.stderr
    assert "restarting the job (restart 1 of 3)" in run.stderr
    assert "restarting the job (restart 2 of 3)" in run.stderr
    assert "job succeeded in attempt 3 of 4" in run.stderr
    assert count.read_text().count("x") == 6


def test_tasks_are_told_which_restart_they_are_in(marker):
    # The sleep lets both tasks print before the first failure stops the attempt.
    script = 'echo "restart=$TFSCALE_RESTART_COUNT"; sleep 0.5; [ "$TFSCALE_RESTART_COUNT" = 2 ]'
    run = run_launcher(
        ["--num_workers", "2", "--max_restarts", "2", "--restart_backoff", "0", "--", "sh", "-c", script],
        marker,
    )
    assert run.returncode == 0, run.stderr
    assert _lines(run.stdout, "worker:1") == ["restart=0", "restart=1", "restart=2"]


def test_job_failing_every_attempt_stops_after_max_restarts(marker, tmp_path):
    count = tmp_path / "count"
    run = run_launcher(
        ["--num_workers", "2", "--max_restarts", "2", "--restart_backoff", "0",
         "--", "sh", "-c", f"echo x >> {count}; exit 5"],
        marker,
    )  # fmt: skip
    assert run.returncode == 1
    assert 3 <= count.read_text().count("x") <= 6  # a peer may be stopped before it writes
    assert run.stderr.count("starting 2 tasks") == 3
    assert (
        "job failed: worker:0 failed (exit code 5) in attempt 3; no restarts left (--max_restarts=2"
        in run.stderr
    )


@pytest.mark.parametrize(
    ("flags", "script", "reason"),
    [
        (["--finish_timeout", "1"], 'case "$TF_CONFIG" in *\\"index\\":1*) exec sleep 60;; esac',
         "worker:1 failed (still running 1s after worker:0 exited 0 (--finish_timeout))"),
        (["--task_timeout", "1"], "exec sleep 60", "still running after 1s (--task_timeout)"),
        (["--heartbeat_timeout", "1"], "echo hello; exec sleep 60",
         "printed nothing for 1s (--heartbeat_timeout)"),
    ],
    ids=["finish_timeout", "task_timeout", "heartbeat_timeout"],
)  # fmt: skip
def test_hung_tasks_fail_the_attempt(marker, flags, script, reason):
    started = time.monotonic()
    run = run_launcher(["--num_workers", "2", *flags, "--", "sh", "-c", script], marker)
    assert time.monotonic() - started < 15
    assert run.returncode == 1
    assert reason in run.stderr


@pytest.mark.parametrize(
    ("flags", "ending"),
    [
        (["--num_workers", "2", "--evaluator"], "worker"),
        (["--chief", "--num_workers", "2", "--num_ps", "1"], "chief"),
    ],
    ids=["evaluator_sidecar", "parameter_servers"],
)
def test_job_ends_when_its_job_ending_tasks_exit_0_and_stops_the_rest(marker, flags, ending):
    # Job-ending tasks exit 0 at once; evaluator / ps / PS-workers would serve forever.
    script = f'case "$TF_CONFIG" in *\\"type\\":\\"{ending}\\"*) exit 0;; esac; exec sleep 60'
    started = time.monotonic()
    run = run_launcher([*flags, "--grace_period", "1", "--", "sh", "-c", script], marker)
    assert run.returncode == 0, run.stderr
    assert time.monotonic() - started < 10


def test_task_ignoring_sigterm_is_killed_after_the_grace_period(marker):
    script = (
        'trap \'\' TERM; case "$TF_CONFIG" in *\\"index\\":1*) exit 1;; esac; while :; do sleep 0.1; done'
    )
    started = time.monotonic()
    run = run_launcher(["--num_workers", "2", "--grace_period", "1", "--", "sh", "-c", script], marker)
    assert 1 <= time.monotonic() - started < 15
    assert run.returncode == 1


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_signal_to_the_launcher_is_forwarded_to_every_task(marker, tmp_path, sig):
    name = sig.name
    script = (
        f'trap "echo got-{name} > {tmp_path}/$$; exit 0" {name[3:]}; echo ready; while :; do sleep 0.1; done'
    )
    proc = start_launcher(["--num_workers", "3", "--max_restarts", "2", "--", "sh", "-c", script], marker)
    ready = 0
    while ready < 3:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
        ready += line.endswith("ready\n")
    proc.send_signal(sig)
    assert proc.wait(timeout=15) == 128 + sig
    stderr = proc.stderr.read()
    assert f"stopped by {name}: forwarded it to every task (attempt 1 of 3)" in stderr
    assert "restarting" not in stderr
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == [f"got-{name}\n"] * 3


def test_restart_reuses_free_ports_and_replaces_taken_ones():
    job = jobs.LocalJob(["true"], 2, chief=True)
    first = job(1)
    assert [t.env["TF_CONFIG"] for t in job(2)] == [t.env["TF_CONFIG"] for t in first]
    port = int(job.spec.cluster["worker"][0].split(":")[1])
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        third = job(3)
    assert str(port) not in json.dumps(ClusterSpec.from_tf_config(third[0].env["TF_CONFIG"]).cluster)
    assert [t.name for t in third] == ["chief:0", "worker:0", "worker:1"]


def test_free_ports_come_from_below_the_ephemeral_range_and_are_bindable(tmp_path, monkeypatch):
    """A port from bind(0) is ephemeral, so an outgoing connection can take it before the task
    binds it (a CI run failed so: "Could not start gRPC server"); tfscale picks below the range."""
    low = _procs._ephemeral_low()
    assert low is not None and low - _procs._PORT_FLOOR >= 1000, low
    ports = _procs.free_ports(8)
    assert len(set(ports)) == 8 and all(_procs._PORT_FLOOR <= p < low for p in ports), ports
    assert _procs.ports_free(ports)
    with socket.socket() as s:  # a port someone listens on is not free, and not picked again
        s.bind(("127.0.0.1", ports[0]))
        s.listen()
        assert not _procs.ports_free(ports[:1])
    # Where the range leaves no room (or cannot be read), the kernel picks.
    for text in ("15500\t60999\n", "garbage"):
        (tmp_path / "range").write_text(text)
        monkeypatch.setattr(_procs, "_EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
        ports = _procs.free_ports(3)
        assert len(set(ports)) == 3 and all(p >= low for p in ports), (text, ports)


def test_keras_compat_shim_keeps_a_users_own_sitecustomize(marker, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("print('user sitecustomize ran')\n")
    code = "import sys; print(sys.path[1].endswith('_keras_compat'), 'keras' in sys.modules)"
    run = run_launcher(
        ["--keras_compat", "--", sys.executable, "-c", code], marker, env={"PYTHONPATH": str(tmp_path)}
    )
    assert run.returncode == 0, run.stderr
    assert _lines(run.stdout, "worker:0") == ["user sitecustomize ran", "True False"]


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (["--num_workers", "0", "--", "true"], {}, "flag --num_workers=0"),
        (["--num_workers", "2"], {}, "Missing command"),
        (["--num_ps", "1", "--", "true"], {}, "`--num_ps`. Received: 1. Parameter servers need"),
        (["--hosts", "a", "--hostfile", "f", "--", "true"], {}, "at most one of `--hosts`"),
        (["--hosts", "a", "--num_workers", "2", "--", "true"], {}, "`--num_workers`=2 with a multi-host"),
        (["--hosts", "a", "--remote_cmd", "ssh {hostname}", "--", "true"], {}, "Received: {hostname}"),
        (["--hosts", "bad host!", "--", "true"], {}, "workers[0]"),
        (["--hostfile", "/nonexistent/hosts", "--", "true"], {}, "/nonexistent/hosts"),
        (["--num_workers", "2", "python", "-c", "1"], {}, "Unknown command line flag 'c'"),
        (["--num_workers", "2", "true"], {}, "expected `--` before the command, e.g. `tfscale-launch [flags] -- true`"),  # noqa: E501
        (["--slurm", "--", "true"], {"SLURM_JOB_ID": ""}, "needs a Slurm allocation"),
        (["--slurm", "--", "true"], {"SLURM_JOB_ID": "7", "PATH": "/nonexistent"}, "needs `srun` on PATH"),
        (["--", "/nonexistent/program"], {}, "`COMMAND`. Received: '/nonexistent/program'"),
        (["--hosts", "a", "--remote_cmd", "nonexistent-ssh {host}", "--", "true"], {},
         "`--remote_cmd`. Received"),
        (["--chief=node0", "--", "true"], {}, "`--chief`. Received: 'node0'. A local job runs every task"),
        (["--chief=a,b", "--", "true"], {}, "--chief=a,b: expected one host[:port] or true/false"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(marker, tmp_path, args, env, message):
    env = dict(env)
    if env.get("SLURM_JOB_ID") == "":
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    log_dir = tmp_path / "logs"
    run = run_launcher(["--log_dir", str(log_dir), *args], marker, env=env)
    assert run.returncode == 2
    errors = run.stderr.splitlines()
    assert len(errors) == 1 and errors[0].startswith("tfscale-launch: error: "), run.stderr
    assert message in errors[0]
    assert not log_dir.exists()


def test_hosts_job_starts_each_task_through_the_remote_command(marker):
    # `env` as the "remote" starter: the tasks run here, started exactly as on another host.
    remote = "env TFSCALE_HOST={host} TFSCALE_HOST_INDEX={host_index}"
    run = run_launcher(
        ["--hosts", "127.0.0.1:2,localhost", "--port", "3100", "--remote_cmd", remote,
         "--", sys.executable, "-c", PRINT_ENV],
        marker,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    seen = {}
    for name in ["worker:0", "worker:1", "worker:2"]:
        (line,) = _lines(run.stdout, name)
        env = json.loads(line)
        seen[name] = (env["TFSCALE_HOST"], env["TFSCALE_HOST_INDEX"], json.loads(env["TF_CONFIG"]))
    workers = ["127.0.0.1:3100", "127.0.0.1:3101", "localhost:3100"]
    assert [v[:2] for v in seen.values()] == [("127.0.0.1", "0"), ("127.0.0.1", "0"), ("localhost", "1")]
    for index, (_, _, tf_config) in enumerate(seen.values()):
        assert tf_config == {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}


def test_chief_and_evaluator_go_on_the_host_they_name_else_in_turn():
    named = jobs.HostsJob(["true"], ["a", "b"], chief="c:3000", evaluator="b", num_ps=1, port=2222)
    assert named.spec.cluster == {
        "chief": ("c:3000",),
        "worker": ("a:2222", "b:2222"),
        "ps": ("a:2223",),
        "evaluator": ("b:2223",),
    }
    assert [t.name for t in named(1)] == ["chief:0", "worker:0", "worker:1", "ps:0", "evaluator:0"]
    in_turn = jobs.HostsJob(["true"], ["a", "b"], chief=True, evaluator=True, port=2222)
    assert dict(in_turn.spec.cluster) == {
        "chief": ("a:2222",),
        "worker": ("a:2223", "b:2222"),
        "evaluator": ("b:2223",),
    }


def test_remote_command_templates():
    env = {"TF_CONFIG": '{"a": 1}'}
    argv = _remote.render(
        "ip netns exec ns{host_index}",
        host="10.0.0.2",
        host_index=1,
        env=env,
        command=["python", "x y.py"],
        cwd="/w",
    )
    assert argv == ["ip", "netns", "exec", "ns1", "env", 'TF_CONFIG={"a": 1}', "python", "x y.py"]
    argv = _remote.render(
        _remote.DEFAULT_REMOTE_CMD,
        host="[::1]",
        host_index=0,
        env=env,
        command=["python", "x y.py"],
        cwd="/w d",
    )
    assert argv[:-1] == ["ssh", "-o", "BatchMode=yes", "-tt", "::1"]
    assert argv[-1] == "cd '/w d' && exec env 'TF_CONFIG={\"a\": 1}' python 'x y.py'"


def test_hosts_job_places_tasks_and_gives_each_its_tf_config(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("10.0.0.1 slots=2\n10.0.0.2\n")
    path = {"PATH": "/usr/sbin:/usr/bin:/bin"}
    job = jobs.HostsJob(["python", "t.py"], hostfile=str(hostfile), chief=True, port=3000,
                        remote_cmd="ip netns exec n{host_index}", environ=path)  # fmt: skip
    tasks = job(1)
    assert [t.name for t in tasks] == ["chief:0", "worker:0", "worker:1", "worker:2"]
    assert [t.argv[3] for t in tasks] == ["n0", "n0", "n0", "n1"]
    assert all(dict(t.env) == path for t in tasks)
    expected = ClusterSpec.from_hosts(
        chief="10.0.0.1:3002", workers=["10.0.0.1:3000", "10.0.0.1:3001", "10.0.0.2:3000"]
    )
    for task, (task_type, index, _) in zip(tasks, expected.tasks()):
        assert task.argv[5] == "TF_CONFIG=" + expected.to_json(task_type, index)
    with pytest.raises(LaunchError, match="`--remote_cmd`"):
        jobs.HostsJob(["true"], ["a"], remote_cmd="ssh {host} {command} {command}")


def test_slurm_task_execs_the_command_with_the_tf_config_of_its_rank(marker):
    slurm = {
        "SLURM_JOB_ID": "7",
        "SLURM_STEP_NODELIST": "node[1-2]",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_PROCID": "3",
    }
    job = jobs.SlurmJob(["python", "t.py"], port=2400, srun="sh", environ=dict(os.environ, **slurm))
    (task,) = job(1)
    assert task.argv[1:3] == ("--kill-on-bad-exit=1", "--label")
    bootstrap = [*task.argv[3:-2], sys.executable, "-c", "import os; print(os.environ['TF_CONFIG'])"]
    env = dict(os.environ, TFSCALE_LAUNCH_TEST_MARKER=marker, **slurm)
    out = subprocess.run(bootstrap, env=env, capture_output=True, text=True, check=True).stdout.strip()
    reference = ClusterSpec.from_slurm(env, port=2400)
    assert json.loads(out) == reference.to_tf_config(reference.task_type, reference.task_index)
    assert json.loads(out)["task"] == {"type": "worker", "index": 3}
    assert json.loads(out)["cluster"]["worker"][3] == "node2:2401"


# Keras's own progress bar, as a user's `fit(verbose=1)` draws it into the launcher's pipe.
PROGBAR = """
import sys, time
from keras.utils import Progbar
bar = Progbar(40, interval=0.01)
for step in range(1, 41):
    time.sleep(0.02)
    bar.update(step, [("loss", 1.0 / step)])
print("done")
"""


def test_progress_bars_become_throttled_prefixed_lines(marker, tmp_path):
    run = subprocess.run(
        [LAUNCHER, "--num_workers", "1", "--", sys.executable, "-c", PROGBAR],
        env=_env(marker, None),
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    out = run.stdout.decode()
    assert not {"\r", "\b", "\x1b"} & set(out), repr(out[:300])
    lines = [line for line in out.splitlines() if not is_startup_noise(line[len("[worker:0] ") :])]
    assert all(line.startswith("[worker:0] ") for line in lines), lines
    # The first state at once, then at most one per PROGRESS_INTERVAL (10 s), and the last state.
    assert 2 <= len(lines) <= 4, lines
    assert lines[-2].startswith("[worker:0] 40/40 ") and "loss:" in lines[-2], lines
    assert lines[-1] == "[worker:0] done"
