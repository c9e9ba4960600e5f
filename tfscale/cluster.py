"""Cluster specs: build, parse and validate `TF_CONFIG` for multi-worker TensorFlow.

A `ClusterSpec` is the cluster (task type -> addresses) plus, optionally, which task
this process is. It is built once from wherever the cluster is described -- a
`TF_CONFIG`, a list of hosts, an MPI/DeepSpeed-style hostfile, Slurm's variables, a
Kubernetes pod -- validated on construction, and turned into the `TF_CONFIG` of any
task:

    spec = ClusterSpec.from_hosts(workers=["node1:2", "node2:2"], port=2222)
    spec.to_json("worker", 3)
    # '{"cluster":{"worker":["node1:2222","node1:2223","node2:2222","node2:2223"]},
    #   "task":{"type":"worker","index":3}}'

Task types mean what they mean to TensorFlow: at most one `chief` (worker 0's role
when absent), any number of `worker`s, parameter servers `ps`, and at most one
`evaluator`, which sits outside the collectives of `MultiWorkerMirroredStrategy`.

The spec is also the one answer to "who am I" for every other module: `is_chief`,
`worker_index`, `num_workers`, `is_writer` (who writes backups, the model and logs) and
`to_resolver()` for `tf.distribute`. `ClusterSpec.local()` is a single process outside
any cluster, so callers never need a `None` case. `TF_CONFIG` is parsed here and only
here (`from_env`, `from_tf_config`).

This module imports no TensorFlow (`to_resolver` imports it when called), so
`tfscale-tfconfig` starts instantly.
"""

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Optional

from tfscale import _hosts, _kubernetes, _slurm, _task_protocol
from tfscale._cluster_errors import ClusterSpecError, describe

__all__ = ["TASK_TYPES", "ClusterSpec", "ClusterSpecError"]

TASK_TYPES = ("chief", "worker", "ps", "evaluator")
_AT_MOST_ONE = ("chief", "evaluator")
# `environment` is what the TFJob operator and Estimator add; TensorFlow reads the
# other two. Anything else is most likely a typo of `cluster` or `task`.
_TF_CONFIG_KEYS = ("cluster", "task", "environment", "rpc_layer", "session_master")
_LOCAL = object()  # `ClusterSpec(_LOCAL)`: what `ClusterSpec.local()` builds, past the validation.


class _Cluster(dict):
    """A read-only dict (hashable, picklable) so a frozen `ClusterSpec` really is frozen."""

    __slots__ = ()

    def _read_only(self, *args, **kwargs):
        raise TypeError("ClusterSpec.cluster is read-only; copy it with dict(spec.cluster)")

    __setitem__ = __delitem__ = __ior__ = clear = pop = popitem = setdefault = update = _read_only

    def __hash__(self):
        return hash(tuple(self.items()))

    def __reduce__(self):
        return (_Cluster, (dict(self),))


def _type_error(name, value):
    return ClusterSpecError(
        f"Invalid task type `{name}`. Received: {describe(value)}. Expected one of {', '.join(TASK_TYPES)}."
    )


def _addresses(value, where):
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ClusterSpecError(
            f"Invalid value for `{where}`. Received: {describe(value)}. Expected a list "
            "of 'host:port' strings."
        )
    return tuple(value)


def _normalize_cluster(cluster):
    """Validates a {task_type: [host:port]} mapping; returns it in TF order without empty types."""
    if not isinstance(cluster, Mapping):
        raise ClusterSpecError(
            f"Invalid value for `cluster`. Received: {describe(cluster)}. Expected an object mapping task "
            "types to lists of 'host:port'."
        )
    for task_type in cluster:
        if task_type not in TASK_TYPES:
            raise _type_error(f"cluster.{task_type}" if isinstance(task_type, str) else "cluster", task_type)
    normalized, seen = {}, {}
    for task_type in TASK_TYPES:
        addresses = _addresses(cluster.get(task_type, ()), f"cluster.{task_type}")
        if task_type in _AT_MOST_ONE and len(addresses) > 1:
            raise ClusterSpecError(
                f"Invalid value for `cluster.{task_type}`: {len(addresses)} addresses. Expected at most one "
                f"{task_type} task."
            )
        for i, address in enumerate(addresses):
            where = f"cluster.{task_type}[{i}]"
            host, port = _hosts.parse_address(address, where)
            key = (host.lower(), port)
            if key in seen:
                raise ClusterSpecError(
                    f"Duplicate address in `{where}`: {address!r} is also `{seen[key]}`. Expected every task "
                    "on its own host:port."
                )
            seen[key] = where
        if addresses:
            normalized[task_type] = addresses
    if not normalized:
        raise ClusterSpecError(
            'Empty cluster: `cluster` names no tasks. Expected at least one, e.g. {"worker": ["host:2222"]}.'
        )
    return _Cluster(normalized)


def _check_task(cluster, task_type, index, type_name="task_type", index_name="task_index"):
    if task_type is None and index is None:
        return
    if task_type not in TASK_TYPES:
        raise _type_error(type_name, task_type)
    if task_type not in cluster:
        raise ClusterSpecError(
            f"Invalid value for `{type_name}`. Received: {task_type!r}. Expected a task type of the cluster: "
            f"{', '.join(cluster)}."
        )
    size = len(cluster[task_type])
    if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < size:
        raise ClusterSpecError(
            f"Invalid value for `{index_name}`. Received: {describe(index)}. Expected an integer in "
            f"0-{size - 1} (the cluster has {size} {task_type!r} task{'s' if size > 1 else ''})."
        )


def _parse_tf_config_text(text):
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ClusterSpecError(
                f"Invalid TF_CONFIG: not UTF-8 ({e.reason}). Expected a JSON object."
            ) from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ClusterSpecError(
            f"Invalid TF_CONFIG: not JSON ({e.msg} at line {e.lineno} column {e.colno}). Received: "
            f"{describe(text)}. Expected a JSON object with `cluster` and `task`."
        ) from None
    except RecursionError:
        raise ClusterSpecError("Invalid TF_CONFIG: JSON nested too deeply. Expected a JSON object.") from None


def _task_of(config):
    task = config.get("task")
    if task is None or task == {}:
        return None, None
    if not isinstance(task, Mapping):
        raise ClusterSpecError(
            f"Invalid value for `task`. Received: {describe(task)}. Expected an object "
            '{"type": ..., "index": ...}.'
        )
    for key in task:
        if key not in ("type", "index"):
            raise ClusterSpecError(
                f"Invalid key in `task`. Received: {describe(key)}. Expected only `type` and `index`."
            )
    for key in ("type", "index"):
        if task.get(key) is None:
            raise ClusterSpecError(
                f"Missing `task.{key}` in TF_CONFIG. Expected both `task.type` and `task.index`."
            )
    return task["type"], task["index"]


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """A validated cluster and, optionally, the task of this process.

    Args:
        cluster: mapping of task type (`chief`, `worker`, `ps`, `evaluator`) to a
            list of 'host:port' addresses. Stored read-only, in that order, without
            empty types, addresses as tuples.
        task_type: this process's task type, or None.
        task_index: this process's index within `task_type`, or None.

    Raises:
        ClusterSpecError: unknown task type, more than one chief or evaluator, a
            malformed address or port, a duplicate address, an empty cluster, or a
            task that is not in the cluster.
    """

    cluster: Mapping
    task_type: Optional[str] = None
    task_index: Optional[int] = None

    def __post_init__(self):
        if self.cluster is _LOCAL:
            object.__setattr__(self, "cluster", _Cluster())
            return
        if not isinstance(self.cluster, _Cluster):
            # A `_Cluster` was validated when it was made (and is read-only): `with_task` on each
            # of N tasks stays linear instead of re-validating all N addresses each time.
            object.__setattr__(self, "cluster", _normalize_cluster(self.cluster))
        _check_task(self.cluster, self.task_type, self.task_index)

    @classmethod
    def local(cls):
        """One process outside any cluster: the chief, the writer, worker 0 of 1.

        What `from_env(allow_unset=True)` returns when `TF_CONFIG` is not set. It has no
        tasks and no addresses.
        """
        return cls(_LOCAL)

    @classmethod
    def from_resolver(cls, resolver):
        """The cluster and task of a `tf.distribute` cluster resolver (`local()` if it names none).

        Only the task types TensorFlow's multi-worker strategies know are kept; a
        strategy that runs outside a cluster has an empty one.
        """
        cluster = {t: list(a) for t, a in resolver.cluster_spec().as_dict().items() if t in TASK_TYPES}
        if not cluster:
            return cls.local()
        task_type = resolver.task_type
        index = None if task_type is None else int(resolver.task_id or 0)
        return cls(cluster, task_type, index)

    @classmethod
    def from_strategy(cls, strategy):
        """The cluster a `tf.distribute` strategy runs in: its cluster resolver's, else `local()`."""
        resolver = getattr(strategy, "cluster_resolver", None)
        return cls.local() if resolver is None else cls.from_resolver(resolver)

    @classmethod
    def of_process(cls, strategy, environ=None):
        """This process's task: the strategy's cluster, else `TF_CONFIG` in `environ` (or local).

        The one answer to "who am I" for a running job: who writes backups and logs
        (`is_writer`), its label (`task_label`, `task_file_label`), how many workers.
        The environment counts for tasks whose strategy runs outside the cluster (an
        evaluator's), which must not write either.
        """
        spec = cls.from_strategy(strategy)
        return cls.from_env(environ, allow_unset=True) if spec.is_local else spec

    @classmethod
    def from_tf_config(cls, config):
        """Parses a `TF_CONFIG` given as a JSON string or an already decoded dict.

        Keeps the task if the config names one. Error messages name the key path
        of the bad value, e.g. `cluster.worker[2]` or `task.index`.
        """
        if isinstance(config, (str, bytes)):
            config = _parse_tf_config_text(config)
        if not isinstance(config, Mapping):
            raise ClusterSpecError(
                f"Invalid TF_CONFIG. Received: {describe(config)}. Expected a JSON object with `cluster` and "
                "`task`."
            )
        for key in config:
            if key not in _TF_CONFIG_KEYS:
                raise ClusterSpecError(
                    f"Invalid key in TF_CONFIG. Received: {describe(key)}. Expected only "
                    f"{', '.join(_TF_CONFIG_KEYS)}."
                )
        if "cluster" not in config:
            raise ClusterSpecError(
                'Missing `cluster` in TF_CONFIG. Expected {"cluster": {...}, "task": {...}}.'
            )
        cluster = _normalize_cluster(config["cluster"])
        task_type, index = _task_of(config)
        _check_task(cluster, task_type, index, "task.type", "task.index")
        return cls(cluster, task_type, index)

    @classmethod
    def from_env(cls, environ=None, *, allow_unset=False):
        """Parses the `TF_CONFIG` variable of `environ` (default `os.environ`).

        Args:
            environ: the environment mapping (default `os.environ`).
            allow_unset: return `ClusterSpec.local()` when `TF_CONFIG` is unset or
                blank, instead of raising.
        """
        environ = os.environ if environ is None else environ
        text = environ.get(_task_protocol.TF_CONFIG_VAR, "")
        if not text.strip():
            if allow_unset:
                return cls.local()
            raise ClusterSpecError(
                "`TF_CONFIG` is not set. Expected a JSON cluster description in the environment."
            )
        return cls.from_tf_config(text)

    @classmethod
    def from_hosts(cls, workers=(), chief=None, ps=(), evaluator=None, port=2222):
        """Builds a cluster from host entries.

        Args:
            workers: worker hosts, a list or a comma-separated string. Each entry is
                `host` (one task), `host:port` with port 1024-65535, or `host:slots`
                with slots 1-1023 (that many tasks, as Horovod's `-H host:4`).
            chief: one `host` or `host:port`, or None.
            ps: parameter-server hosts, like `workers`.
            evaluator: one `host` or `host:port`, or None.
            port: base port. Tasks without an explicit port take the next port on
                their host from here up, skipping ports given explicitly.
        """
        return cls(_hosts.cluster_from_hosts(workers, chief, ps, evaluator, port))

    @classmethod
    def from_hostfile(cls, path, port=2222):
        """Reads an MPI/DeepSpeed-style hostfile: `host slots=N` lines, `#` comments, blank lines.

        A host with N slots becomes N worker tasks on consecutive ports from `port`.
        """
        try:
            text = _hosts.read_text_file(path)
        except (OSError, TypeError, ValueError) as e:  # UnicodeDecodeError is a ValueError
            reason = getattr(e, "strerror", None) or str(e)
            raise ClusterSpecError(
                f"Cannot read hostfile `path`={describe(path)}: {reason}. Expected a "
                "readable UTF-8 text file."
            ) from None
        return cls(_hosts.cluster_from_hostfile(text, str(path), port))

    @classmethod
    def from_slurm(cls, environ=None, port=2222):
        """The cluster of a Slurm job (or `srun` step) with this task's place in it.

        Every Slurm task is a worker. Reads `SLURM_STEP_NODELIST`,
        `SLURM_STEP_TASKS_PER_NODE` and `SLURM_STEP_NUM_TASKS` inside `srun`, else
        `SLURM_JOB_NODELIST`, `SLURM_TASKS_PER_NODE` and `SLURM_NTASKS`; plus
        `SLURM_PROCID`. Tasks on one node listen on consecutive ports from `port`.
        """
        environ = os.environ if environ is None else environ
        cluster, rank = _slurm.cluster_from_slurm(environ, _hosts.check_port(port))
        return cls(cluster, "worker", rank)

    @classmethod
    def from_kubernetes(
        cls,
        environ=None,
        *,
        port=2222,
        replicas=None,
        service=None,
        namespace=None,
        cluster_domain="cluster.local",
    ):
        """The cluster of a Kubernetes pod.

        In a Kubeflow TFJob the operator injects `TF_CONFIG`; it is parsed as it is.
        Otherwise the pod is taken to be a StatefulSet replica named `<set>-<i>`
        (its `HOSTNAME`) behind the headless service `service` (or `TFSCALE_SERVICE`),
        with `replicas` (or `TFSCALE_REPLICAS`) workers in namespace `namespace` (or
        `POD_NAMESPACE`, default "default"), each at
        `<set>-<i>.<service>.<namespace>.svc.<cluster_domain>:<port>`.
        """
        environ = os.environ if environ is None else environ
        if environ.get(_task_protocol.TF_CONFIG_VAR, "").strip():
            return cls.from_env(environ)
        cluster, ordinal = _kubernetes.cluster_from_statefulset(
            environ,
            port=_hosts.check_port(port),
            replicas=replicas,
            service=service,
            namespace=namespace,
            domain=cluster_domain,
        )
        return cls(cluster, "worker", ordinal)

    def tasks(self):
        """Every task as (task_type, index, address): chief, workers, ps, evaluator."""
        return [(t, i, a) for t, addresses in self.cluster.items() for i, a in enumerate(addresses)]

    @property
    def task_count(self):
        """The number of tasks of every type."""
        return sum(len(addresses) for addresses in self.cluster.values())

    @property
    def is_local(self):
        """True for `ClusterSpec.local()`: one process, no cluster."""
        return not self.cluster

    @property
    def num_workers(self):
        """Workers as `MultiWorkerMirroredStrategy` counts them: the chief plus the workers (1 if local)."""
        if self.is_local:
            return 1
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def worker_index(self):
        """This task's place among the `num_workers` (chief first, as TensorFlow numbers them).

        0 when local; None for a `ps` or `evaluator` task, or when no task is set.
        """
        if self.is_local:
            return 0
        if self.task_type not in ("chief", "worker"):
            return None
        return self.task_index + (1 if self.task_type == "worker" and "chief" in self.cluster else 0)

    @property
    def is_multi_worker(self):
        """True when this task is one of several workers (it joins the collectives)."""
        return self.num_workers > 1 and self.worker_index is not None

    @property
    def is_chief(self):
        """True for the task that leads the job: `chief`, or worker 0 when the cluster has no chief.

        Also True when local, or when no task is set (a process that only describes the
        cluster). `ps` and `evaluator` tasks are never chief.
        """
        if self.is_local or self.task_type is None:
            return True
        if "chief" in self.cluster:
            return self.task_type == "chief"
        return self.task_type == "worker" and self.task_index == 0

    @property
    def is_writer(self):
        """True for the one task that writes backups, the final model and logs: the chief.

        Every other task reads; two writers of one directory would race.
        """
        return self.is_chief

    @property
    def task_label(self):
        """ "type:index" of this task, or "local" when this process is no task of a cluster."""
        return "local" if self.task_type is None else f"{self.task_type}:{self.task_index}"

    @property
    def task_file_label(self):
        """ "type-index" of this task (for file and folder names), or "local"."""
        return self.task_label.replace(":", "-")

    def to_resolver(self):
        """A `tf.distribute.cluster_resolver.SimpleClusterResolver` of this cluster and task.

        Imports TensorFlow. Local gives an empty cluster, as TensorFlow has outside one.
        """
        import tensorflow as tf

        return tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec({t: list(a) for t, a in self.cluster.items()}),
            task_type=self.task_type,
            task_id=self.task_index,
            rpc_layer="grpc",
        )

    def with_task(self, task_type, index):
        """The same cluster with this process's task set to (`task_type`, `index`)."""
        return dataclasses.replace(self, task_type=task_type, task_index=index)

    def task_address(self, task_type=None, index=None):
        """The 'host:port' of a task (default: this process's task)."""
        spec = self._for(task_type, index)
        if spec.task_type is None:
            raise ClusterSpecError(
                "No task given and this ClusterSpec has none. Expected `task_type` and `index`."
            )
        return spec.cluster[spec.task_type][spec.task_index]

    def to_tf_config(self, task_type=None, index=None):
        """The `TF_CONFIG` dict of a task (default: this process's; no `task` key if it has none)."""
        spec = self._for(task_type, index)
        config = {"cluster": {t: list(addresses) for t, addresses in spec.cluster.items()}}
        if spec.task_type is not None:
            config["task"] = {"type": spec.task_type, "index": spec.task_index}
        return config

    def to_json(self, task_type=None, index=None):
        """`to_tf_config` as compact JSON, ready for the `TF_CONFIG` variable."""
        return json.dumps(self.to_tf_config(task_type, index), separators=(",", ":"))

    def _for(self, task_type, index):
        if task_type is None and index is None:
            return self
        return self.with_task(task_type, index)
