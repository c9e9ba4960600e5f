"""`tfscale-tfconfig`: print the TF_CONFIG of a cluster's tasks, or write Slurm/Kubernetes job files.

    tfscale-tfconfig --from=hosts --workers=node1:2,node2:2            # every task, one JSON per line
    tfscale-tfconfig --from=hostfile --hostfile=hosts --task=worker:3 --format=export
    eval "$(tfscale-tfconfig --from=slurm --format=export)"            # inside srun: this task's
    tfscale-tfconfig --sbatch=job.sbatch --nodes=4 --ntasks_per_node=2 --command='python train.py'
    tfscale-tfconfig --tfjob=job.yaml --image=me/train:1 --replicas=chief=1,worker=3 \\
        --command='python train.py'

Bad input ends with one line on stderr and exit code 2; nothing is half-written.
"""

import json
import os
import shlex
import signal
import sys

from absl import flags

from tfscale import errors
from tfscale import flags as tfscale_flags
from tfscale._hosts import host_of
from tfscale.cluster import TASK_TYPES, ClusterSpec
from tfscale.launch import jobfiles

__all__ = ["define_flags", "main", "run"]

_PROG = "tfscale-tfconfig"

_SOURCE_FLAGS = {
    "hosts": ("hosts", "chief", "ps", "evaluator", "port"),
    "hostfile": ("hostfile", "port"),
    "slurm": ("port",),
    "env": (),
    "kubernetes": ("port",),
}
_SBATCH_FLAGS = ("sbatch", "nodes", "ntasks_per_node", "partition", "time")
_TFJOB_FLAGS = ("tfjob", "image", "replicas", "namespace")
_PRINT_FLAGS = ("from", "task", "format", "hosts", "chief", "ps", "evaluator", "hostfile")


class _UsageError(errors.Error):
    """Flags that do not go together (names them and what was expected)."""


def define_flags(flag_values):
    """Defines the flags of `tfscale-tfconfig` on `flag_values`."""
    fv = flag_values
    flags.DEFINE_enum("from", None, list(_SOURCE_FLAGS), "Where the cluster is described.", flag_values=fv)
    # --hosts (--workers), --chief, --ps, --evaluator, --hostfile, --port: as in tfscale-launch.
    tfscale_flags.define_cluster_source_flags(fv, ("hosts", "hostfile", "port", "chief", "ps", "evaluator"))
    flags.DEFINE_string(
        "task",
        None,
        "'all', or TYPE:INDEX such as worker:1. Default: this process's task if the source "
        "names one (slurm, env, kubernetes), else all.",
        flag_values=fv,
    )
    flags.DEFINE_enum(
        "format", "json", ["json", "export"], "JSON, or shell `export TF_CONFIG='...'`.", flag_values=fv
    )
    flags.DEFINE_string("sbatch", None, "Write a Slurm sbatch script here.", flag_values=fv)
    flags.DEFINE_integer("nodes", 1, "Slurm nodes (--sbatch).", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer(
        "ntasks_per_node", 1, "Slurm tasks, i.e. workers, per node (--sbatch).", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_string("partition", None, "Slurm partition (--sbatch).", flag_values=fv)
    flags.DEFINE_string("time", None, "Slurm time limit, e.g. 2:00:00 (--sbatch).", flag_values=fv)
    flags.DEFINE_string("tfjob", None, "Write a Kubeflow TFJob manifest (YAML) here.", flag_values=fv)
    flags.DEFINE_string("image", None, "Container image (--tfjob).", flag_values=fv)
    flags.DEFINE_list(
        "replicas", ["worker=2"], "TFJob replicas as TYPE=N: chief, worker, ps, evaluator.", flag_values=fv
    )
    flags.DEFINE_string("namespace", None, "Kubernetes namespace (--tfjob).", flag_values=fv)
    flags.DEFINE_string("command", None, "Command each task runs (--sbatch, --tfjob).", flag_values=fv)
    flags.DEFINE_string("job_name", "tfscale", "Job name (--sbatch, --tfjob).", flag_values=fv)


def _present(fv, names):
    return [name for name in names if fv[name].present]


def _forbid(fv, names, context):
    extra = _present(fv, names)
    if extra:
        raise _UsageError(f"`--{extra[0]}` is not used {context}. Expected it only where its help says.")


def _spec(fv):
    source = fv["from"].value
    if source is None:
        raise _UsageError(f"Missing `--from`. Expected one of {', '.join(_SOURCE_FLAGS)}.")
    unused = [n for names in _SOURCE_FLAGS.values() for n in names if n not in _SOURCE_FLAGS[source]]
    _forbid(fv, unused, f"with --from={source}")
    if source == "hosts":
        return _spec_from_hosts(fv)
    if source == "hostfile":
        if not fv.hostfile:
            raise _UsageError("Missing `--hostfile` for --from=hostfile. Expected the path of a hostfile.")
        return ClusterSpec.from_hostfile(fv.hostfile, fv.port)
    if source == "slurm":
        return ClusterSpec.from_slurm(os.environ, fv.port)
    if source == "kubernetes":
        return ClusterSpec.from_kubernetes(os.environ, port=fv.port)
    return ClusterSpec.from_env(os.environ)


def _spec_from_hosts(fv):
    workers = fv.hosts or []
    if not (workers or isinstance(fv.chief, str)):
        raise _UsageError(
            "Missing `--workers` (alias of `--hosts`), or `--chief=HOST`, for --from=hosts. Expected e.g. "
            "--workers=node1,node2."
        )
    # A bare --chief / --evaluator goes on the first host, as tfscale-launch places it.
    first = host_of(workers[0]) if workers else None
    chief = first if fv.chief is True else (fv.chief or None)
    evaluator = first if fv.evaluator is True else (fv.evaluator or None)
    return ClusterSpec.from_hosts(workers, chief, fv.ps, evaluator, fv.port)


def _selected_tasks(spec, task):
    if task is None:
        return [(spec.task_type, spec.task_index)] if spec.task_type else [(t, i) for t, i, _ in spec.tasks()]
    if task == "all":
        return [(t, i) for t, i, _ in spec.tasks()]
    task_type, sep, index = task.partition(":")
    if not sep or task_type not in TASK_TYPES or not (index.isascii() and index.isdigit() and len(index) < 7):
        raise _UsageError(
            f"Invalid value for `--task`. Received: {task!r}. Expected 'all' or TYPE:INDEX with TYPE one of "
            f"{', '.join(TASK_TYPES)}, e.g. worker:0."
        )
    if int(index) >= len(spec.cluster.get(task_type, ())):
        raise _UsageError(
            f"Invalid value for `--task`. Received: {task!r}. Expected one of the cluster's tasks: "
            + ", ".join(f"{t}:0-{len(a) - 1}" for t, a in spec.cluster.items())
            + "."
        )
    return [(task_type, int(index))]


def _print_tf_configs(fv):
    spec = _spec(fv)
    # Each line holds the whole cluster: written one at a time, never all held in memory.
    # The cluster's JSON once, not once a task: what `spec.to_json(task_type, index)` gives, spliced.
    cluster = spec.with_task(None, None).to_json()
    for task_type, index in _selected_tasks(spec, fv.task):
        task = json.dumps({"type": task_type, "index": index}, separators=(",", ":"))
        text = f'{cluster[:-1]},"task":{task}}}'
        print(f"export TF_CONFIG={shlex.quote(text)}" if fv.format == "export" else text)


def _write_job_files(fv):
    _forbid(fv, _PRINT_FLAGS, "when writing job files (--sbatch/--tfjob)")
    if not fv.sbatch:
        _forbid(fv, _SBATCH_FLAGS, "without --sbatch")
    if not fv.tfjob:
        _forbid(fv, _TFJOB_FLAGS, "without --tfjob")
    _check_utf8(fv, ("command", "image", "partition", "time", "namespace", "job_name"))
    command = jobfiles.parse_command(fv.command)
    texts = []
    if fv.sbatch:
        script = jobfiles.sbatch_script(
            command=command,
            nodes=fv.nodes,
            ntasks_per_node=fv.ntasks_per_node,
            port=fv.port,
            job_name=fv.job_name,
            partition=fv.partition,
            time=fv.time,
        )
        texts.append((fv.sbatch, script, 0o755))
    if fv.tfjob:
        if not fv.image:
            raise _UsageError(
                "Missing `--image` for --tfjob. Expected a container image with tfscale installed."
            )
        replicas = jobfiles.parse_replicas(fv.replicas)
        manifest = jobfiles.tfjob_manifest(
            image=fv.image,
            command=command,
            replicas=replicas,
            port=fv.port,
            job_name=fv.job_name,
            namespace=fv.namespace,
        )
        texts.append((fv.tfjob, manifest, 0o644))
    # Everything is checked before the first file is written, and both files are written or neither.
    try:
        jobfiles.write_all_atomic(texts)
    except OSError as e:
        flag = "tfjob" if fv.tfjob and e.filename == fv.tfjob else "sbatch"
        raise _UsageError(
            f"Cannot write `--{flag}`={e.filename!r}: {e.strerror or e}. Expected a writable path."
        ) from None
    for path, _, _ in texts:
        print(f"wrote {_printable(path)}")


def _printable(text):
    """`text` as UTF-8 can show it: a path's undecodable bytes (surrogate escapes) as \\xNN."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _check_utf8(fv, names):
    """Job files are UTF-8 text: a flag holding undecodable bytes is one line, not a traceback."""
    for name in names:
        value = fv[name].value
        try:
            (value or "").encode("utf-8")
        except UnicodeEncodeError:
            raise _UsageError(
                f"Invalid value for `--{name}`. Received: {value!r}, which is not UTF-8. Expected UTF-8 text."
            ) from None


def main(argv, flag_values):
    """Runs the command with parsed `flag_values`; returns the exit code."""
    fv = flag_values
    try:
        if len(argv) > 1:
            raise _UsageError(f"Unexpected argument {argv[1]!r}. Expected only --flags.")
        if fv.sbatch or fv.tfjob:
            _write_job_files(fv)
        else:
            _forbid(fv, (*_SBATCH_FLAGS, *_TFJOB_FLAGS, "command", "job_name"), "without --sbatch or --tfjob")
            _print_tf_configs(fv)
    except errors.Error as e:  # ClusterSpecError, bad flag combinations: one line.
        return errors.report(_PROG, e)
    return 0


def run(argv=None):
    """Console-script entry point (`tfscale-tfconfig`), on its own `FlagValues`: exits with the status."""
    argv = list(sys.argv if argv is None else argv)
    fv = flags.FlagValues()
    define_flags(fv)
    if any(a in ("-h", "--help", "--helpshort", "--helpfull") for a in argv[1:]):
        print(__doc__ + "\n" + fv.get_help())
        sys.exit(0)
    try:
        tfscale_flags.check_flagfiles(argv)
        rest = fv(argv)  # --flagfile is handled here too.
    except flags.Error as e:
        sys.exit(errors.report(_PROG, e))
    try:
        status = main(rest, fv)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader left (`| head`): no traceback; the status a shell gives a SIGPIPE death,
        # and stdout pointed at /dev/null so the interpreter's final flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        status = 128 + signal.SIGPIPE
    sys.exit(status)


if __name__ == "__main__":
    run()
