"""Process plumbing shared by the local cluster helper and the launcher.

Every task runs in its own session (process group), so stopping a task stops
everything it started, and no process outlives the helper that started it.
"""

import os
import random
import signal
import socket
import subprocess
import time

__all__ = ["describe_exit", "free_ports", "ports_free", "start", "stop", "stop_with_signal"]


# Ports are picked from this floor up to the kernel's ephemeral range. A port that bind(0)
# returns is ephemeral: between that check and the task's own bind, any outgoing connection on
# the machine (another job's gRPC client, say) may take it as its local port. That happened in
# a CI run ("Failed to add port to server ... Could not start gRPC server"). Ports below the
# ephemeral range are never handed out to outgoing connections.
_PORT_FLOOR = 15000
_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def _ephemeral_low():
    """The first port of the kernel's ephemeral range, or None where it cannot be read."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _bindable(port, host):
    """True when `port` can be bound on `host` and on 0.0.0.0 (where TensorFlow's server binds)."""
    for address in dict.fromkeys([host, "0.0.0.0"]):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((address, port))
        except OSError:
            return False
        finally:
            s.close()
    return True


def free_ports(count, host="127.0.0.1"):
    """Returns `count` distinct TCP ports that were free on `host` a moment ago.

    They come from below the ephemeral range where it leaves room (see `_PORT_FLOOR`), so no
    outgoing connection takes one before the task binds it.
    """
    low = _ephemeral_low()
    ports = []
    if low is not None and low - _PORT_FLOOR >= 1000:
        for port in random.SystemRandom().sample(range(_PORT_FLOOR, low), 200):
            if len(ports) == count:
                return ports
            if _bindable(port, host):
                ports.append(port)
    # No room below the ephemeral range, or 200 ports there taken: let the kernel pick the rest.
    sockets = []
    try:
        while len(ports) + len(sockets) < count:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            sockets.append(s)
        return ports + [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def start(argv, *, env, log_file, cwd=None):
    """Starts `argv` in a new process group with stdout+stderr into `log_file`."""
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log_file,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop(procs, grace_seconds=5.0, hurry=None):
    """Terminates the process groups of `procs`, then kills what is left after the grace period."""
    stop_with_signal(procs, signal.SIGTERM, grace_seconds, hurry)


def describe_exit(returncode):
    """'exit code 3' or 'signal SIGKILL' for a Popen returncode."""
    if returncode is None:
        return "still running"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def stop_with_signal(procs, sig, grace_seconds=5.0, hurry=None):
    """Sends `sig` to the process groups of `procs` (e.g. a forwarded SIGINT); SIGKILL after the grace.

    `hurry`, a callable asked every 50 ms, may cut the grace: it returns the seconds left
    from now (e.g. the launcher got SIGTERM during a long resize grace), or None.
    """
    for p in procs:
        _signal_group(p, sig)
    deadline = time.monotonic() + grace_seconds
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline:
            cut = hurry() if hurry is not None else None
            if cut is not None:
                deadline, hurry = min(deadline, time.monotonic() + cut), None
            left = max(0.0, deadline - time.monotonic())
            try:
                p.wait(timeout=min(left, 0.05) if hurry is not None else left)
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        # SIGKILL the whole group even when the leader has exited: its children may not have.
        _signal_group(p, signal.SIGKILL)
        if p.poll() is None:
            p.wait()


def ports_free(ports, host="127.0.0.1"):
    """True when every port in `ports` can be bound on `host` (and 0.0.0.0) right now."""
    return all(_bindable(port, host) for port in ports)
