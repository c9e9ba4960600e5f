"""`tfscale-launch [flags] -- COMMAND [ARGS...]`: run COMMAND as a cluster job, restart it on failure.

    tfscale-launch --num_workers 2 -- python main.py
    tfscale-launch --num_workers 4 --max_restarts 3 --log_dir logs -- python train.py
    tfscale-launch --hosts node1,node2:2 --max_restarts 2 -- python train.py
    tfscale-launch --hosts 10.0.0.1,10.0.0.2 --remote_cmd 'ip netns exec ns{host_index}' -- python train.py
    tfscale-launch --slurm -- python train.py          # inside salloc / sbatch
    tfscale-launch -np 4 -H node1:2,node2:2 python train.py   # Horovod's spellings (`--` optional)

Exit status: 0 when the job finally succeeded, 1 when it failed on its last
allowed attempt, 128+N when signal N stopped the launcher, 2 for bad flags.
This module only turns flags into plain values; see `supervisor` and `jobs`.
"""

import sys

from absl import flags

from tfscale import errors
from tfscale import flags as tfscale_flags
from tfscale.cluster import ClusterSpec
from tfscale.launch import _remote, elastic, jobs, supervisor

__all__ = ["define_flags", "job_from_flags", "main", "run"]


def define_flags(fv):
    """Defines the launcher's flags on the `FlagValues` `fv`."""
    elastic.define_num_workers(fv)  # N, or MIN:MAX for an elastic job
    # --hosts (--workers), --hostfile, --port, --chief, --num_ps, --evaluator: as in tfscale-tfconfig.
    tfscale_flags.define_cluster_source_flags(
        fv, ("hosts", "hostfile", "port", "chief", "num_ps", "evaluator")
    )
    flags.DEFINE_string(
        "remote_cmd",
        _remote.DEFAULT_REMOTE_CMD,
        "Per-host start command; placeholders {host}, {host_index}, {command}.",
        flag_values=fv,
    )
    flags.DEFINE_bool("slurm", False, "Inside a Slurm allocation: start the tasks with srun.", flag_values=fv)
    flags.DEFINE_integer(
        "max_restarts", 0, "Restarts of the whole job after a failure.", lower_bound=0, flag_values=fv
    )
    flags.DEFINE_float(
        "restart_backoff", 1.0, "Seconds between a failure and the restart.", lower_bound=0, flag_values=fv
    )
    flags.DEFINE_float(
        "grace_period",
        10.0,
        "Seconds between SIGTERM and SIGKILL when stopping tasks.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_float("task_timeout", None, "Seconds one attempt may run.", lower_bound=0, flag_values=fv)
    flags.DEFINE_float(
        "finish_timeout",
        120.0,
        "Seconds the other tasks get after a chief/worker exited 0.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "heartbeat_timeout", None, "Seconds a running task may print nothing.", lower_bound=0, flag_values=fv
    )
    flags.DEFINE_string(
        "log_dir", None, "Write each task's output to <log_dir>/<type>-<index>.log.", flag_values=fv
    )
    flags.DEFINE_bool(
        "keras_compat",
        False,
        "Apply tfscale's Keras 3 fixes for Mirrored/MultiWorkerMirrored strategies in every task "
        "(the set tfscale.strategies.get applies, via a sitecustomize on PYTHONPATH), for "
        "programs that build their own strategy and do not import tfscale.",
        flag_values=fv,
    )
    flags.register_validator("log_dir", _valid_log_dir, flag_values=fv)
    # absl's lower_bound lets nan and inf through (nan fails no comparison): a nan
    # --task_timeout would silently switch the timeout off.
    for name in ("restart_backoff", "grace_period", "task_timeout", "finish_timeout", "heartbeat_timeout"):
        flags.register_validator(
            name, _finite_or_none, f"--{name} expects a finite number of seconds >= 0.", flag_values=fv
        )
    elastic.define_flags(fv)
    _define_horovod_spellings(fv)


# horovodrun's spellings: `-np N` is --num_workers, `-H` is --hosts; with either, the
# command may follow the flags without `--`, as `horovodrun -np 2 python train.py` does.
_HOROVOD_ALIASES = {"np": "num_workers", "H": "hosts"}


def _define_horovod_spellings(fv):
    for alias, name in _HOROVOD_ALIASES.items():
        flags.DEFINE_alias(alias, name, flag_values=fv)


def _horovod_style(options):
    """True when the flags use `-np` or `-H` (then parsing stops at the command)."""
    return any(a.split("=", 1)[0] in ("-np", "--np", "-H", "--H") for a in options)


def _first_slots(fv):
    """`--hosts` entries for the first `--num_workers` slots of `--hosts`/`--hostfile` (Horovod's -np)."""
    spec = (
        ClusterSpec.from_hostfile(fv.hostfile, port=fv.port)
        if fv.hostfile is not None
        else ClusterSpec.from_hosts(fv.hosts, port=fv.port)
    )
    workers = list(spec.cluster.get("worker", ()))
    if (
        isinstance(fv.num_workers, bool)
        or not isinstance(fv.num_workers, int)
        or fv.num_workers > len(workers)
    ):
        raise supervisor.LaunchError(
            f"Invalid flags: `--num_workers`={fv.num_workers} with a multi-host job of {len(workers)} slots. "
            "Expected at most the hosts' slots (`host:N`, `slots=N`): -np N starts the first N."
        )
    return workers[: fv.num_workers]


def _finite_or_none(value):
    return value is None or 0 <= value < float("inf")


def _valid_log_dir(value):
    if value is None or value.strip():
        return True
    raise flags.ValidationError(f"--log_dir={value!r} is empty. Expected a folder for the task logs.")


def _positive_or_none(value):
    return value if value else None


def job_from_flags(fv, command):
    """The job (`attempt -> [TaskSpec]`) the flags describe."""
    multi_host = fv.hosts is not None or fv.hostfile is not None
    if sum([multi_host, fv.slurm]) > 1 or (fv.hosts is not None and fv.hostfile is not None):
        raise supervisor.LaunchError(
            "Invalid flags: expected at most one of `--hosts`, `--hostfile` and `--slurm`."
        )
    hosts = fv.hosts
    if multi_host and fv.num_workers is not None:
        hosts = _first_slots(fv)
    elif fv.slurm and fv.num_workers is not None:
        raise supervisor.LaunchError(
            f"Invalid flags: `--num_workers`={fv.num_workers} with a multi-host or Slurm job. Expected the "
            "worker count from the hosts' slots (`host:N`, `slots=N`) or from Slurm."
        )
    if fv.slurm:
        if fv.chief or fv.num_ps or fv.evaluator:
            raise supervisor.LaunchError(
                "Invalid flags: `--slurm` starts workers only; drop --chief/--num_ps/--evaluator."
            )
        return jobs.SlurmJob(command, port=fv.port, keras_compat=fv.keras_compat)
    topology = {
        "chief": fv.chief,
        "num_ps": fv.num_ps,
        "evaluator": fv.evaluator,
        "keras_compat": fv.keras_compat,
    }
    if multi_host:
        hostfile = None if hosts is not fv.hosts else fv.hostfile
        return jobs.HostsJob(
            command, hosts, hostfile=hostfile, port=fv.port, remote_cmd=fv.remote_cmd, **topology
        )
    return jobs.LocalJob(command, fv.num_workers or 1, **topology)


def main(argv, fv):
    """Runs the job of the flags in `fv` and the command `argv[1:]`; returns the exit status."""
    try:
        if elastic.requested(fv):
            return elastic.main(fv, argv[1:])
        job = job_from_flags(fv, argv[1:])
        result = supervisor.launch(
            job,
            max_restarts=fv.max_restarts,
            restart_backoff=fv.restart_backoff,
            grace_period=fv.grace_period,
            task_timeout=_positive_or_none(fv.task_timeout),
            finish_timeout=fv.finish_timeout or None,
            heartbeat_timeout=_positive_or_none(fv.heartbeat_timeout),
            log_dir=fv.log_dir,
        )
    except errors.Error as e:  # LaunchError, ClusterSpecError, ...: one line, never a traceback.
        return errors.report("tfscale-launch", e)
    return result.exit_code


def parse(argv, fv):
    """Parses `argv` into `fv`; returns `argv[0]` + the command, or an exit status for --help / bad flags."""
    options = argv[1 : argv.index("--")] if "--" in argv else argv[1:]
    if any(a in ("-h", "--help", "-help", "--helpfull") for a in options):
        print(__doc__.split("\n\n")[0] + "\n\n" + fv.get_help())
        return 0
    horovod_style = "--" not in argv and _horovod_style(options)
    try:
        tfscale_flags.check_flagfiles(argv)
        fv.set_gnu_getopt(not horovod_style)  # Horovod style: the first non-flag starts the command
        parsed = fv(argv)
    except flags.Error as e:
        hint = "" if "--" in argv else " (put `--` between the flags and the command)"
        return errors.report("tfscale-launch", f"{e}{hint}")
    if "--" not in argv and parsed[1:] and not horovod_style:
        # Without it, a command's own flags would be read as ours (or refused as unknown).
        print(
            f"tfscale-launch: error: expected `--` before the command, "
            f"e.g. `tfscale-launch [flags] -- {' '.join(parsed[1:])}`",
            file=sys.stderr,
        )
        return 2
    return parsed


def run(argv=None):
    """Console-script entry point: exits with the job's status."""
    # Own FlagValues, not absl.app's global FLAGS: absl.logging already owns `--log_dir` there.
    fv = flags.FlagValues()
    define_flags(fv)
    parsed = parse(sys.argv if argv is None else argv, fv)
    sys.exit(parsed if isinstance(parsed, int) else main(parsed, fv))


if __name__ == "__main__":
    run()
