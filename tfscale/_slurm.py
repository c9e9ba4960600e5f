"""Slurm job/step variables -> a cluster dict and this task's index, for `ClusterSpec.from_slurm`.

Inside `srun` a task sees the step's variables (`SLURM_STEP_NODELIST`,
`SLURM_STEP_TASKS_PER_NODE`, `SLURM_STEP_NUM_TASKS`); in the batch script only
the job's (`SLURM_JOB_NODELIST` or `SLURM_NODELIST`, `SLURM_TASKS_PER_NODE`,
`SLURM_NTASKS`). One set is read whole, never mixed. Ranks (`SLURM_PROCID`) map to
nodes the way Slurm's default block distribution places them (consecutive ranks fill
a node, nodes in node-list order), or round-robin when `SLURM_DISTRIBUTION` says
cyclic. The tasks on one node listen on consecutive ports from the base port, as in
TensorFlow's `SlurmClusterResolver`.
"""

import collections
import re

from tfscale._cluster_errors import ClusterSpecError, describe
from tfscale._hosts import MAX_TASKS

__all__ = ["cluster_from_slurm", "expand_hostlist", "expand_tasks_per_node"]

_STEP_VARS = ("SLURM_STEP_NODELIST", "SLURM_STEP_TASKS_PER_NODE", "SLURM_STEP_NUM_TASKS")
_JOB_VARS = ("SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS")
_PART_RE = re.compile(r"([^\[\],]*)(?:\[([^\[\]]*)\])?")
_RANGE_RE = re.compile(r"([0-9]{1,9})(?:-([0-9]{1,9}))?")
_TASKS_RE = re.compile(r"([0-9]{1,6})(?:\(x([0-9]{1,6})\))?")
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]*")


def _bad(var, value, expected):
    return ClusterSpecError(
        f"Invalid Slurm variable `{var}`. Received: {describe(value)}. Expected {expected}."
    )


def _split_top_level(text, var):
    """Splits at commas outside brackets: 'a[1-2,4],b' -> ['a[1-2,4]', 'b']."""
    parts, depth, current = [], 0, []
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise _bad(var, text, "balanced, non-nested brackets as in 'node[001-003,007]'")
        if char == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
    if depth:
        raise _bad(var, text, "balanced, non-nested brackets as in 'node[001-003,007]'")
    return [*parts, "".join(current)]


def _expand_ranges(ranges, var, text):
    """'001-003,7' -> ['001', '002', '003', '7'] (zero padding kept, as Slurm prints it)."""
    values = []
    for item in ranges.split(","):
        match = _RANGE_RE.fullmatch(item)
        if match is None:
            raise _bad(var, text, "ranges of numbers in brackets, e.g. '[001-003,007]'")
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise _bad(var, text, f"ranges with low <= high (got {item!r})")
        if int(high) - int(low) + 1 + len(values) > MAX_TASKS:
            raise _bad(var, text, f"at most {MAX_TASKS} nodes")
        values.extend(str(i).zfill(len(low)) for i in range(int(low), int(high) + 1))
    return values


def _expand_part(part, var, text):
    """One host expression, possibly with several bracket groups ('rack[1-2]-n[1-3]')."""
    hosts, pos = [""], 0
    while pos < len(part):
        match = _PART_RE.match(part, pos)
        prefix, ranges = match.group(1), match.group(2)
        if match.end() == pos or not _NAME_RE.fullmatch(prefix):
            raise _bad(var, text, "host names of letters, digits, '.', '-', '_' with bracket ranges")
        pos = match.end()
        suffixes = [prefix] if ranges is None else [prefix + r for r in _expand_ranges(ranges, var, text)]
        if len(hosts) * len(suffixes) > MAX_TASKS:
            raise _bad(var, text, f"at most {MAX_TASKS} nodes")
        hosts = [h + s for h in hosts for s in suffixes]
    return hosts


def expand_hostlist(text, var="SLURM_JOB_NODELIST"):
    """'node[001-003,007],gpu-a[1-2]' -> ['node001', 'node002', 'node003', 'node007', 'gpu-a1', 'gpu-a2']."""
    hosts = []
    for part in _split_top_level(text.strip(), var):
        if not part:
            raise _bad(var, text, "a comma-separated node list with no empty entries")
        hosts.extend(_expand_part(part, var, text))
        if len(hosts) > MAX_TASKS:
            raise _bad(var, text, f"at most {MAX_TASKS} nodes")
    for host in hosts:
        if not host or host[0] in ".-":
            raise _bad(var, text, f"valid host names (got {host!r})")
    return hosts


def expand_tasks_per_node(text, var="SLURM_TASKS_PER_NODE"):
    """'2(x3),1' -> [2, 2, 2, 1]."""
    counts = []
    for item in text.strip().split(","):
        match = _TASKS_RE.fullmatch(item)
        if match is None:
            raise _bad(var, text, "a list like '2(x3),1': N tasks, or N(xM) for M nodes with N tasks each")
        count, repeat = int(match.group(1)), int(match.group(2) or 1)
        if count < 1 or repeat < 1:
            raise _bad(var, text, "task and node counts of at least 1")
        if len(counts) + repeat > MAX_TASKS:
            raise _bad(var, text, f"at most {MAX_TASKS} tasks")
        counts.extend([count] * repeat)
    if sum(counts) > MAX_TASKS:
        raise _bad(var, text, f"at most {MAX_TASKS} tasks")
    return counts


def _variables(environ):
    """Picks the step's variables inside srun, else the job's; returns (names, values)."""
    names = _STEP_VARS if environ.get("SLURM_STEP_NODELIST") else _JOB_VARS
    if names is _JOB_VARS and not environ.get("SLURM_JOB_NODELIST") and environ.get("SLURM_NODELIST"):
        names = ("SLURM_NODELIST", *_JOB_VARS[1:])
    for name in (names[0], names[1], "SLURM_PROCID"):
        if not environ.get(name, "").strip():
            raise ClusterSpecError(
                f"Slurm variable `{name}` is not set. Expected to run inside a Slurm job (sbatch/srun), "
                f"with `{names[0]}`, `{names[1]}` and `SLURM_PROCID` set."
            )
    return names, [environ.get(name) for name in names]


def _rank_layout(counts, distribution):
    """[(node_index, local_index)] for each rank, as Slurm's block or cyclic distribution places them."""
    if distribution == "block":
        return [(node, local) for node, count in enumerate(counts) for local in range(count)]
    layout, active, local = [], list(range(len(counts))), 0
    while active:  # one pass per slot; full nodes drop out, so the work is linear in the tasks
        layout.extend((node, local) for node in active)
        local += 1
        active = [node for node in active if counts[node] > local]
    return layout


def _distribution(environ):
    value = environ.get("SLURM_DISTRIBUTION", "block").strip() or "block"
    node_level = value.split(":")[0].split(",")[0]
    node_level = "block" if node_level == "*" else node_level  # '*' is Slurm's "default" (block)
    if node_level not in ("block", "cyclic"):
        raise _bad(
            "SLURM_DISTRIBUTION", value, "'block' or 'cyclic' (tfscale cannot place ranks of other layouts)"
        )
    return node_level


def _integer(environ, name, upper):
    value = environ.get(name, "").strip()
    if not value.isascii() or not value.isdigit() or len(value) > 9 or int(value) >= upper:
        raise _bad(name, environ.get(name), f"an integer in 0-{upper - 1}")
    return int(value)


def _check_consistent(environ, names, hosts, counts, ntasks):
    if len(counts) != len(hosts):
        raise ClusterSpecError(
            f"Inconsistent Slurm variables: `{names[0]}` lists {len(hosts)} nodes but `{names[1]}` "
            f"describes {len(counts)}. Expected one task count per node."
        )
    duplicates = sorted(host for host, n in collections.Counter(hosts).items() if n > 1)
    if duplicates:
        raise _bad(names[0], environ[names[0]], f"each node once (repeated: {', '.join(duplicates[:3])})")
    if ntasks is not None and ntasks != sum(counts):
        raise ClusterSpecError(
            f"Inconsistent Slurm variables: `{names[2]}`={ntasks} but `{names[1]}` adds up to "
            f"{sum(counts)} tasks. Expected them to agree."
        )


def cluster_from_slurm(environ, port):
    """Returns (`{"worker": [addresses]}`, this task's index) from the Slurm variables in `environ`."""
    names, (nodelist, tasks_per_node, ntasks_text) = _variables(environ)
    hosts = expand_hostlist(nodelist, names[0])
    counts = expand_tasks_per_node(tasks_per_node, names[1])
    ntasks = _integer(environ, names[2], MAX_TASKS + 1) if (ntasks_text or "").strip() else None
    _check_consistent(environ, names, hosts, counts, ntasks)
    if port + max(counts) - 1 > 65535:
        raise ClusterSpecError(
            f"Out of ports: {max(counts)} tasks on one node from base `port`={port} go past 65535. "
            "Expected a lower base port."
        )
    layout = _rank_layout(counts, _distribution(environ))
    rank = _integer(environ, "SLURM_PROCID", len(layout))
    node, local = layout[rank]
    _check_own_placement(environ, rank, hosts[node], local)
    return {"worker": [f"{hosts[n]}:{port + i}" for n, i in layout]}, rank


def _check_own_placement(environ, rank, host, local):
    """Where Slurm says which node/slot this task is on, it must match the computed layout."""
    node_name = environ.get("SLURMD_NODENAME", "").strip()
    if node_name and node_name != host:
        raise ClusterSpecError(
            f"Inconsistent Slurm variables: `SLURM_PROCID`={rank} falls on node {host!r} by the node list "
            f"and tasks per node, but `SLURMD_NODENAME`={node_name!r}. Expected the same node."
        )
    local_id = environ.get("SLURM_LOCALID", "").strip()
    if local_id and local_id != str(local):
        raise ClusterSpecError(
            f"Inconsistent Slurm variables: `SLURM_PROCID`={rank} is task {local} on its node by the node "
            f"list and tasks per node, but `SLURM_LOCALID`={local_id!r}. Expected the same."
        )
