"""What `tfscale-launch` starts: the tasks of a local, multi-host or Slurm job, one attempt at a time.

Each job is a callable `attempt -> [TaskSpec]` for `Supervisor`. Every task
gets the launcher's environment unchanged plus its own `TF_CONFIG` (and, only
with `keras_compat=True`, the compat shim in front of `PYTHONPATH`).

Which tasks end the job: the chief and the workers, or the chief alone when the
cluster has parameter servers (ParameterServerStrategy's workers and servers
run until stopped). An evaluator is a sidecar: its failure fails the job, and it
is stopped when training is done.
"""

import hashlib
import os
import resource
import shutil
import sys

from tfscale import _task_protocol
from tfscale.launch import _procs, _remote
from tfscale.launch.supervisor import LaunchError, TaskSpec

__all__ = ["HostsJob", "LocalJob", "SlurmJob", "compat_env", "keras_compat_dir", "task_env"]

_LOCAL_HOST = "127.0.0.1"


def keras_compat_dir():
    """The folder whose `sitecustomize.py` calls `tfscale.compat.apply_strategy_fixes()` as Keras loads."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_keras_compat")


def compat_env(base):
    """`{"PYTHONPATH": ...}` with the compat shim in front of the `PYTHONPATH` of environment `base`."""
    current = base.get("PYTHONPATH")
    return {"PYTHONPATH": keras_compat_dir() + (os.pathsep + current if current else "")}


RESTART_COUNT_VAR = _task_protocol.RESTART_COUNT_VAR
JOB_ID_VAR = _task_protocol.JOB_ID_VAR  # read by tfscale.callbacks.BackupAndRestore (its `job_id`)
TF_CONFIG_VAR = _task_protocol.TF_CONFIG_VAR


def job_id(base):
    """The job's id: the user's `TFSCALE_JOB_ID`, else one derived from this launch (the same
    command line in the same folder is the same job, so a relaunch resumes its backups)."""
    launch = repr((os.getcwd(), sys.argv)).encode("utf-8", "backslashreplace")
    return base.get(JOB_ID_VAR) or "launch-" + hashlib.sha256(launch).hexdigest()[:16]


def task_env(tf_config, keras_compat, base, restart_count=0):
    """The variables a task gets on top of its environment `base`.

    TF_CONFIG; `TFSCALE_RESTART_COUNT` (0 in the first attempt, like torchrun's
    TORCHELASTIC_RESTART_COUNT), so a task can tell a restart from a fresh start;
    and the PYTHONPATH of the `--keras_compat` shim when asked.
    """
    env = {TF_CONFIG_VAR: tf_config, RESTART_COUNT_VAR: str(restart_count), JOB_ID_VAR: job_id(base)}
    if keras_compat:
        env.update(compat_env(base))
    return env


def _cluster_spec():
    from tfscale.cluster import ClusterSpec

    return ClusterSpec


def _check_command(command):
    if not command:
        raise LaunchError(
            "Missing command. Expected `tfscale-launch [flags] -- COMMAND [ARGS...]`, e.g. "
            "`tfscale-launch --num_workers 2 -- python main.py`."
        )
    return list(command)


def _check_program(program, environ, what="COMMAND"):
    """Fails before anything starts when `program` cannot be run here."""
    if shutil.which(program, path=environ.get("PATH", os.defpath)) is None:
        raise LaunchError(
            f"Invalid value for `{what}`. Received: {program!r}. Expected an executable file or a program "
            "on PATH."
        )


def _check_count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise LaunchError(
            f"Invalid value for `--{name}`. Received: {value!r}. Expected an integer >= {minimum}."
        )


def _check_open_files(count):
    """Refuses a local job of more tasks than this process can hold open files for."""
    # Each running task holds its output pipe and, with --log_dir, its log open here: past
    # the open-file limit the job would fail only after hundreds of processes had started.
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    most = (soft - 64) // 2
    if soft != resource.RLIM_INFINITY and count > most:
        raise LaunchError(
            f"Invalid value for `--num_workers`: a local job of {count} tasks needs about {2 * count} open "
            f"files, and this process may open {soft} (ulimit -n). Expected at most {most} tasks on one "
            "host, or --hosts to spread them."
        )


def _role(task_type, has_ps):
    if task_type == "evaluator":
        return "sidecar"
    if task_type == "chief" or (task_type == "worker" and not has_ps):
        return "completes"
    return "server"


def _check_local(name, value):
    if isinstance(value, str):
        raise LaunchError(
            f"Invalid value for `--{name}`. Received: {value!r}. A local job runs every task on this host; "
            f"expected a bare `--{name}` (or a multi-host job with --hosts / --hostfile)."
        )


def _in_turn(value, names, turn):
    """Where an extra task goes: the host it names, the host in turn when it is just on, or nowhere."""
    if isinstance(value, str):
        return value
    return names[turn % len(names)] if value else None


def _check_topology(chief, num_ps):
    if num_ps and not chief:
        raise LaunchError(
            f"Invalid value for `--num_ps`. Received: {num_ps}. Parameter servers need a coordinator: "
            "also pass `--chief`."
        )


class LocalJob:
    """All tasks on this host, on free loopback ports (the same ones again on restart if still free).

    Args:
        command: the user's command (list of words), run as is by every task.
        num_workers: "worker" tasks.
        chief: add a "chief" task (True; a host is refused: every task runs here).
        num_ps: "ps" tasks (needs `chief`).
        evaluator: add an "evaluator" task (True, like `chief`).
        keras_compat: put the Keras 3 compat shim on `PYTHONPATH` (Mirrored/MWMS fixes).
        environ: the environment the tasks start from (default `os.environ`).
    """

    def __init__(
        self,
        command,
        num_workers=1,
        *,
        chief=False,
        num_ps=0,
        evaluator=False,
        keras_compat=False,
        environ=None,
    ):
        self.command = _check_command(command)
        _check_count("num_workers", num_workers, 1)
        _check_count("num_ps", num_ps, 0)
        _check_local("chief", chief)
        _check_local("evaluator", evaluator)
        _check_topology(chief, num_ps)
        self._counts = (bool(chief), num_workers, num_ps, bool(evaluator))
        _check_open_files(sum(self._counts))
        self._keras_compat = keras_compat
        self._environ = dict(os.environ if environ is None else environ)
        _check_program(self.command[0], self._environ)
        self._ports = None
        self.spec = None

    def __call__(self, attempt):
        chief, num_workers, num_ps, evaluator = self._counts
        count = chief + num_workers + num_ps + evaluator
        if self._ports is None or not _procs.ports_free(self._ports, _LOCAL_HOST):
            self._ports = _procs.free_ports(count, _LOCAL_HOST)
        addresses = iter(f"{_LOCAL_HOST}:{p}" for p in self._ports)
        self.spec = _cluster_spec().from_hosts(
            chief=next(addresses) if chief else None,
            workers=[next(addresses) for _ in range(num_workers)],
            ps=[next(addresses) for _ in range(num_ps)],
            evaluator=next(addresses) if evaluator else None,
        )
        tasks = []
        for task_type, index, _ in self.spec.tasks():
            env = dict(self._environ)
            config = self.spec.to_json(task_type, index)
            env.update(task_env(config, self._keras_compat, self._environ, attempt - 1))
            tasks.append(TaskSpec(f"{task_type}:{index}", tuple(self.command), env, _role(task_type, num_ps)))
        return tasks


class HostsJob:
    """Tasks on several hosts, each started by a `--remote_cmd` template (ssh by default).

    Args:
        command: the user's command, the same on every host.
        hosts: worker host entries (`host`, `host:port`, `host:slots`), or None with `hostfile`.
        hostfile: path of a `host slots=N` file (see `ClusterSpec.from_hostfile`).
        port: first port on each host.
        chief, num_ps, evaluator: extra tasks, placed on the hosts in turn from the first;
            `chief` and `evaluator` may instead name their host ("node0" or "node0:3000").
        remote_cmd: the start-command template (see `tfscale.launch._remote`).
        keras_compat: pass the compat shim on `PYTHONPATH` (it must exist at the same
            path on every host).
        cwd: the directory remote shells change to (default: the launcher's).
    """

    def __init__(
        self,
        command,
        hosts=None,
        *,
        hostfile=None,
        port=2222,
        chief=False,
        num_ps=0,
        evaluator=False,
        remote_cmd=_remote.DEFAULT_REMOTE_CMD,
        keras_compat=False,
        cwd=None,
        environ=None,
    ):
        self.command = _check_command(command)
        if (hosts is None) == (hostfile is None):
            raise LaunchError("Invalid flags: expected exactly one of `--hosts` and `--hostfile`.")
        _check_count("num_ps", num_ps, 0)
        _check_topology(chief, num_ps)
        self._environ = dict(os.environ if environ is None else environ)
        _check_program(_remote.check_template(remote_cmd)[0], self._environ, "--remote_cmd")
        cluster_spec = _cluster_spec()
        if hostfile is not None:
            workers = list(cluster_spec.from_hostfile(hostfile, port=port).cluster["worker"])
        else:
            workers = [h.strip() for h in hosts if h.strip()]
            if not workers:
                raise LaunchError(f"Invalid value for `--hosts`. Received: {hosts!r}. Expected host names.")
        names = list(dict.fromkeys(_remote.host_of(w) for w in workers))
        turn = int(chief is True)  # A chief placed in turn takes the first host.
        self.spec = cluster_spec.from_hosts(
            workers=workers,
            chief=_in_turn(chief, names, 0),
            ps=[names[(turn + i) % len(names)] for i in range(num_ps)],
            evaluator=_in_turn(evaluator, names, turn + num_ps),
            port=port,
        )
        # Worker hosts first, in order; then a host only a named chief or evaluator runs on.
        hosts = dict.fromkeys([*names, *(_remote.host_of(a) for _, _, a in self.spec.tasks())])
        self._host_index = {name: i for i, name in enumerate(hosts)}
        self._remote_cmd = remote_cmd
        self._keras_compat = keras_compat
        self._cwd = cwd or os.getcwd()

    def __call__(self, attempt):
        has_ps = bool(self.spec.cluster.get("ps"))
        tasks = []
        for task_type, index, address in self.spec.tasks():
            host = _remote.host_of(address)
            argv = _remote.render(
                self._remote_cmd,
                host=host,
                host_index=self._host_index[host],
                env=task_env(
                    self.spec.to_json(task_type, index), self._keras_compat, self._environ, attempt - 1
                ),
                command=self.command,
                cwd=self._cwd,
            )
            tasks.append(
                TaskSpec(f"{task_type}:{index}", tuple(argv), self._environ, _role(task_type, has_ps))
            )
        return tasks


class SlurmJob:
    """Inside a Slurm allocation: one `srun` step starts every task; each derives its TF_CONFIG.

    `srun` starts `python -m tfscale.launch._slurm_task --port P -- COMMAND` once
    per Slurm task; that computes `ClusterSpec.from_slurm(os.environ, port)` and
    execs COMMAND with it as TF_CONFIG. The supervisor watches the one `srun`
    process (`--kill-on-bad-exit=1` makes Slurm stop the step when a task fails)
    and restarts the step on failure.
    """

    def __init__(self, command, *, port=2222, keras_compat=False, srun="srun", environ=None):
        self.command = _check_command(command)
        self._environ = dict(os.environ if environ is None else environ)
        if "SLURM_JOB_ID" not in self._environ:
            raise LaunchError(
                "Invalid flags: `--slurm` needs a Slurm allocation (SLURM_JOB_ID is not set). Expected to "
                "run inside `salloc` or an `sbatch` script."
            )
        self.srun = shutil.which(srun, path=self._environ.get("PATH"))
        if self.srun is None:
            raise LaunchError(
                f"Invalid flags: `--slurm` needs `{srun}` on PATH, and it is not there. Expected a Slurm "
                "client installation on this node."
            )
        self._port = port
        self._keras_compat = keras_compat

    def argv(self):
        """The `srun` command line of the step."""
        bootstrap = [sys.executable, "-m", "tfscale.launch._slurm_task", "--port", str(self._port), "--"]
        return [self.srun, "--kill-on-bad-exit=1", "--label", *bootstrap, *self.command]

    def __call__(self, attempt):
        env = dict(self._environ, **{RESTART_COUNT_VAR: str(attempt - 1), JOB_ID_VAR: job_id(self._environ)})
        if self._keras_compat:
            env.update(compat_env(self._environ))
        return [TaskSpec("srun", tuple(self.argv()), env, "completes")]
