"""Addresses, host lists and MPI/DeepSpeed-style hostfiles -> a cluster dict for `ClusterSpec`.

A host entry is `host`, `host:port` or `host:slots`. The number after the colon is a
port when it is 1024-65535 and a slot count (Horovod's `-H host:4`) when it is
1-1023; ports below 1024 need root and no TensorFlow server uses them. Tasks
without an explicit port get the next port on their host counting up from the base
port, skipping ports given explicitly for that host, so `host:4` is four tasks on
four consecutive ports.
"""

import os
import re
import stat

from tfscale._cluster_errors import ClusterSpecError, describe

__all__ = [
    "MAX_TASKS",
    "check_port",
    "cluster_from_hostfile",
    "cluster_from_hosts",
    "host_of",
    "parse_address",
    "read_text_file",
]

MAX_TASKS = 100_000  # far above any real cluster; keeps a typo such as slots=10000000 from hanging
# A hostfile or TF_CONFIG of MAX_TASKS tasks is a few MB: a bigger file is the wrong file.
MAX_FILE_BYTES = 64 << 20
_MIN_PORT_SUFFIX = 1024


def read_text_file(path):
    """The UTF-8 text of the regular file `path`, read at most `MAX_FILE_BYTES`.

    A device (/dev/zero: a whole read never ends), a pipe (open blocks) or a folder is
    refused before it is opened.

    Raises:
        OSError: it cannot be read (`strerror` says why).
        ValueError: it is not a regular file, is too big, or is not UTF-8 (the message says).
    """
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ValueError("not a regular file (a folder, a device or a pipe)")
    with open(path, "rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


_HOST = r"(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,252})|\[[0-9A-Fa-f:.]{2,45}\])"
_ADDRESS_RE = re.compile(rf"({_HOST}):([0-9]{{1,5}})")
_ENTRY_RE = re.compile(rf"({_HOST})(?::([0-9]{{1,6}}))?")
_HOSTNAME_RE = re.compile(_HOST)


def check_port(port, name="port"):
    """Returns `port` if it is an int in 1-65535, else raises `ClusterSpecError` naming `name`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(port)}. Expected a TCP port in 1-65535."
        )
    return port


def host_of(address):
    """The host part of 'host', 'host:port' or '[v6]:port'."""
    if address.startswith("["):
        return address[: address.index("]") + 1]
    return address.split(":", 1)[0]


def parse_address(address, where):
    """Splits `'host:port'` into `(host, port)`; `where` names it in errors (`cluster.worker[2]`)."""
    if not isinstance(address, str):
        raise ClusterSpecError(
            f"Invalid value for `{where}`. Received: {describe(address)}. Expected a 'host:port' string."
        )
    match = _ADDRESS_RE.fullmatch(address)
    if match is None:
        raise ClusterSpecError(
            f"Invalid value for `{where}`. Received: {describe(address)}. Expected 'host:port' (host: "
            "letters, digits, '.', '-', '_' or a bracketed IPv6 address; port: 1-65535)."
        )
    port = int(match.group(2))
    if not 1 <= port <= 65535:
        raise ClusterSpecError(
            f"Invalid port in `{where}`. Received: {describe(address)}. Expected a port in 1-65535."
        )
    return match.group(1), port


def _parse_entry(text, where):
    """`host`, `host:port` or `host:slots` -> (host, port or None, slots)."""
    if not isinstance(text, str):
        raise ClusterSpecError(
            f"Invalid value for `{where}`. Received: {describe(text)}. Expected 'host', 'host:port' or "
            "'host:slots'."
        )
    match = _ENTRY_RE.fullmatch(text.strip())
    if match is None:
        raise ClusterSpecError(
            f"Invalid value for `{where}`. Received: {describe(text)}. Expected 'host', 'host:port' (port "
            f"{_MIN_PORT_SUFFIX}-65535) or 'host:slots' (slots 1-{_MIN_PORT_SUFFIX - 1})."
        )
    host, suffix = match.group(1), match.group(2)
    if suffix is None:
        return host, None, 1
    number = int(suffix)
    if 1 <= number < _MIN_PORT_SUFFIX:
        return host, None, number
    if _MIN_PORT_SUFFIX <= number <= 65535:
        return host, number, 1
    raise ClusterSpecError(
        f"Invalid port or slot count in `{where}`. Received: {describe(text)}. Expected a port in "
        f"{_MIN_PORT_SUFFIX}-65535 or a slot count in 1-{_MIN_PORT_SUFFIX - 1}."
    )


def _host_list(value, name):
    if value is None:
        return []
    if isinstance(value, str):
        return [part for part in value.split(",") if part.strip()] if value.strip() else []
    try:
        return list(value)
    except TypeError:
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(value)}. Expected a list of hosts."
        ) from None


def _single(value, name):
    if value is None:
        return []
    if not isinstance(value, str):
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(value)}. Expected one host string or None."
        )
    entry = _parse_entry(value, name)
    if entry[2] != 1:
        raise ClusterSpecError(
            f"Invalid value for `{name}`. Received: {describe(value)}. Expected one task ({name} cannot "
            "have slots: a cluster has at most one)."
        )
    return [value]


def cluster_from_hosts(workers=(), chief=None, ps=(), evaluator=None, port=2222):
    """Host entries by task type -> `{task_type: [addresses]}` (see the module docstring)."""
    check_port(port)
    entries = []
    for task_type, hosts in (
        ("chief", _single(chief, "chief")),
        ("worker", _host_list(workers, "workers")),
        ("ps", _host_list(ps, "ps")),
        ("evaluator", _single(evaluator, "evaluator")),
    ):
        name = "workers" if task_type == "worker" else task_type
        for i, text in enumerate(hosts):
            where = f"{name}[{i}]" if task_type in ("worker", "ps") else name
            entries.append((task_type, *_parse_entry(text, where), where))
    return _assign_ports(entries, port)


def _assign_ports(entries, base_port):
    """(task_type, host, port|None, slots, where) entries -> cluster dict with every port filled in."""
    total = sum(slots for _, _, _, slots, _ in entries)
    if total > MAX_TASKS:
        raise ClusterSpecError(f"Too many tasks: {total} requested. Expected at most {MAX_TASKS}.")
    taken = {}
    for _, host, port, _, _ in entries:
        if port is not None:
            taken.setdefault(host.lower(), set()).add(port)
    next_port = {}
    cluster = {}
    for task_type, host, port, slots, where in entries:
        addresses = cluster.setdefault(task_type, [])
        if port is not None:
            addresses.append(f"{host}:{port}")
            continue
        key = host.lower()
        candidate = next_port.get(key, base_port)
        for _ in range(slots):
            while candidate in taken.get(key, ()):
                candidate += 1
            if candidate > 65535:
                raise ClusterSpecError(
                    f"Out of ports for `{where}`: host {host!r} needs ports above 65535 counting up from "
                    f"`port`={base_port}. Expected a lower base port or fewer tasks on this host."
                )
            addresses.append(f"{host}:{candidate}")
            candidate += 1
        next_port[key] = candidate
    return cluster


def _hostfile_line(tokens, where):
    host = tokens[0]
    if not _HOSTNAME_RE.fullmatch(host):
        raise ClusterSpecError(
            f"Invalid host in {where}. Received: {describe(host)}. Expected a host name or IP address."
        )
    options = {}
    for token in tokens[1:]:
        key, sep, value = token.partition("=")
        key = key.replace("-", "_")
        if not sep or key not in ("slots", "max_slots") or key in options:
            raise ClusterSpecError(
                f"Invalid field in {where}. Received: {describe(token)}. Expected 'slots=N' (and optionally "
                "'max_slots=M'), once each."
            )
        if not value.isdigit() or not value.isascii() or len(value) > 7:
            raise ClusterSpecError(
                f"Invalid value in {where}. Received: {describe(token)}. Expected {key}=N with N a positive "
                "integer."
            )
        options[key] = int(value)
    slots = options.get("slots", 1)
    if not 1 <= slots <= options.get("max_slots", slots):
        raise ClusterSpecError(
            f"Invalid slots in {where}. Received: slots={slots}, max_slots={options.get('max_slots')}. "
            "Expected 1 <= slots <= max_slots."
        )
    return host, slots


def cluster_from_hostfile(text, path, port=2222):
    """Hostfile text (`host slots=N` lines, `#` comments) -> `{"worker": [addresses]}`."""
    check_port(port)
    entries, seen = [], {}
    for lineno, line in enumerate(text.splitlines(), start=1):
        tokens = line.split("#", 1)[0].split()
        if not tokens:
            continue
        where = f"{path}:{lineno}"
        host, slots = _hostfile_line(tokens, where)
        if host.lower() in seen:
            raise ClusterSpecError(
                f"Duplicate host {host!r} in {where} (first on line {seen[host.lower()]}). Expected each "
                "host once, with all its slots on that line."
            )
        seen[host.lower()] = lineno
        entries.append(("worker", host, None, slots, where))
    if not entries:
        raise ClusterSpecError(
            f"Empty hostfile {path!r}: no host lines. Expected lines like 'node1 slots=4'."
        )
    return _assign_ports(entries, port)
