"""Job files for a cluster: a Slurm sbatch script and a Kubeflow TFJob manifest.

Starting a job is the launcher's concern, so they live here; `tfscale-tfconfig` (a binary, a
layer above) writes them through this public module.

Both are plain text built here without extra dependencies (the YAML uses JSON-quoted
scalars, which every YAML parser reads) and written atomically: a temporary file in
the destination folder, then a rename, so a failure leaves no half-written job file.
"""

import errno
import json
import os
import re
import shlex
import tempfile

from tfscale._cluster_errors import ClusterSpecError, describe
from tfscale._hosts import MAX_TASKS, check_port

__all__ = [
    "parse_command",
    "parse_replicas",
    "sbatch_script",
    "tfjob_manifest",
    "write_all_atomic",
    "write_atomic",
]

_REPLICA_NAMES = {"chief": "Chief", "worker": "Worker", "ps": "PS", "evaluator": "Evaluator"}
_SLURM_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,128}")
_SLURM_TIME_RE = re.compile(r"[0-9]{1,6}(?:[-:][0-9]{1,2}){0,3}")
_K8S_NAME_RE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_IMAGE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,511}")

_SBATCH = """#!/bin/bash
# Written by tfscale-tfconfig. One TensorFlow worker per Slurm task: each task
# computes its own TF_CONFIG from Slurm's variables inside the job step, so the
# cluster always matches the nodes Slurm actually allocated.
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node={ntasks_per_node}
#SBATCH --output={job_name}-%j.out
{extra}set -euo pipefail

# Override with the path of tfscale-tfconfig if the job's PATH does not have it.
export TFSCALE_TFCONFIG="${{TFSCALE_TFCONFIG:-tfscale-tfconfig}}"

tfscale_task() {{
  local tf_config_export
  tf_config_export="$("$TFSCALE_TFCONFIG" --from=slurm --port={port} --format=export)" || exit 1
  eval "$tf_config_export"
  exec "$@"
}}
export -f tfscale_task

srun --kill-on-bad-exit=1 bash -c 'tfscale_task "$@"' tfscale_task {command}
"""


def parse_command(command):
    """A command line string -> argv list (shell quoting rules)."""
    try:
        argv = shlex.split(command or "")
    except ValueError as e:
        raise ClusterSpecError(
            f"Invalid value for `--command`. Received: {describe(command)}. Expected a "
            f"shell command line ({e})."
        ) from None
    if not argv:
        raise ClusterSpecError(
            "Missing `--command`. Expected the command each task runs, e.g. 'python train.py'."
        )
    return argv


def _checked(value, pattern, name, expected):
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(value)}. Expected {expected}."
        )
    return value


def _positive(value, name, upper=MAX_TASKS):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= upper:
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(value)}. Expected 1-{upper}."
        )
    return value


def sbatch_script(*, command, nodes, ntasks_per_node, port, job_name="tfscale", partition=None, time=None):
    """The text of an sbatch script that runs `command` (argv) once per Slurm task."""
    _checked(job_name, _SLURM_NAME_RE, "job_name", "letters, digits, '.', '-' or '_'")
    _positive(nodes, "nodes")
    _positive(ntasks_per_node, "ntasks_per_node")
    if nodes * ntasks_per_node > MAX_TASKS:
        raise ClusterSpecError(
            f"Too many tasks: {nodes} nodes x {ntasks_per_node}. Expected at most {MAX_TASKS}."
        )
    check_port(port)
    if port + ntasks_per_node - 1 > 65535:
        raise ClusterSpecError(
            f"Out of ports: {ntasks_per_node} tasks per node from `port`={port} go past 65535. "
            "Expected a lower port."
        )
    extra = ""
    if partition:
        extra += (
            f"#SBATCH --partition={_checked(partition, _SLURM_NAME_RE, 'partition', 'a partition name')}\n"
        )
    if time:
        extra += (
            f"#SBATCH --time={_checked(time, _SLURM_TIME_RE, 'time', 'a Slurm time such as 1-00:00:00')}\n"
        )
    return _SBATCH.format(
        job_name=job_name,
        nodes=nodes,
        ntasks_per_node=ntasks_per_node,
        extra=extra,
        port=port,
        command=" ".join(shlex.quote(arg) for arg in command),
    )


def parse_replicas(items):
    """['worker=2', 'chief=1'] -> {'chief': 1, 'worker': 2} in TF order."""
    counts = {}
    for item in items:
        task_type, sep, count = item.partition("=")
        task_type = task_type.strip().lower()
        if not sep or task_type not in _REPLICA_NAMES or task_type in counts:
            raise ClusterSpecError(
                f"Invalid value for `--replicas`. Received: {describe(item)}. Expected TYPE=N "
                f"with TYPE one of {', '.join(_REPLICA_NAMES)}, each once."
            )
        count = count.strip()
        upper = 1 if task_type in ("chief", "evaluator") else MAX_TASKS
        if not (count.isascii() and count.isdigit() and len(count) < 7 and 1 <= int(count) <= upper):
            raise ClusterSpecError(
                f"Invalid value for `--replicas`. Received: {describe(item)}. Expected a count in 1-{upper}."
            )
        counts[task_type] = int(count)
    if not counts.get("chief") and not counts.get("worker"):
        raise ClusterSpecError(
            f"Invalid value for `--replicas`. Received: {describe(','.join(items))}. Expected "
            "a chief or workers."
        )
    return {t: counts[t] for t in _REPLICA_NAMES if t in counts}


def tfjob_manifest(*, image, command, replicas, port, job_name="tfscale", namespace=None):
    """The YAML text of a Kubeflow TFJob (kubeflow.org/v1) running `command` in `image`."""
    _checked(job_name, _K8S_NAME_RE, "job_name", "a DNS label (lowercase letters, digits, '-'; at most 63)")
    if namespace is not None:
        _checked(namespace, _K8S_NAME_RE, "namespace", "a DNS label (lowercase letters, digits, '-')")
    _checked(image, _IMAGE_RE, "image", "a container image reference such as 'tensorflow/tensorflow:2.21.0'")
    check_port(port)
    q = json.dumps
    lines = ["apiVersion: kubeflow.org/v1", "kind: TFJob", "metadata:", f"  name: {q(job_name)}"]
    if namespace is not None:
        lines.append(f"  namespace: {q(namespace)}")
    lines += ["spec:", "  tfReplicaSpecs:"]
    for task_type, count in replicas.items():
        lines += [
            f"    {_REPLICA_NAMES[task_type]}:",
            f"      replicas: {count}",
            "      restartPolicy: OnFailure",
            "      template:",
            "        spec:",
            "          containers:",
            '            - name: "tensorflow"',  # the container name the TFJob operator looks for
            f"              image: {q(image)}",
            f"              command: {q(list(command))}",
            "              ports:",
            '                - name: "tfjob-port"',  # the port the operator writes into TF_CONFIG
            f"                  containerPort: {port}",
        ]
    return "\n".join(lines) + "\n"


def write_all_atomic(files):
    """Writes every `(path, text, mode)` of `files`, or none of them.

    Each text goes to a temporary file in its destination folder first; only when all are
    written are they renamed into place. Should a rename fail, the files already renamed
    get their old content back (or are removed when there was none).

    Raises:
        OSError: a file cannot be written (its `filename` says which); nothing changed.
    """
    staged = []  # (path, temporary file, backup of the old file or None)
    try:
        for path, text, mode in files:
            if os.path.lexists(path) and not os.path.isfile(path):
                # Never rename over a folder or a device node (root could): only a regular file.
                raise OSError(errno.EEXIST, "exists and is not a regular file", path)
            try:
                _stage(path, text, mode, staged)
            except OSError as e:
                e.filename = path  # ENOSPC from a write names no file
                raise
        _rename_all(staged)
    finally:
        for _, tmp, _ in staged:
            if os.path.lexists(tmp):
                os.remove(tmp)


def _stage(path, text, mode, staged):
    fd, tmp = tempfile.mkstemp(prefix=".tfscale-", dir=os.path.dirname(os.path.abspath(path)))
    staged.append((path, tmp, None))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(tmp, mode)


def _rename_all(staged):
    done = []  # (path, backup of its old content or None) of the renames that worked
    try:
        for path, tmp, _ in staged:
            backup = None
            if os.path.isfile(path):  # kept, under a hard link, until every rename worked
                backup = tmp + ".old"
                os.link(path, backup)
            try:
                os.replace(tmp, path)
            except OSError as e:
                if backup is not None:
                    os.remove(backup)  # the failed rename left its target as it was
                e.filename = path
                raise
            done.append((path, backup))
    except BaseException:
        for path, backup in reversed(done):
            if backup is not None:
                os.replace(backup, path)
            else:
                os.remove(path)
        raise
    for _, backup in done:
        if backup is not None:
            os.remove(backup)


def write_atomic(path, text, mode=0o644):
    """Writes `text` to `path` through a temporary file in the same folder and a rename."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tfscale-", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
