"""Process plumbing shared by the local cluster helper and the launcher.

Every task runs in its own session (process group), so stopping a task stops
everything it started, and no process outlives the helper that started it.
"""

import os
import signal
import socket
import subprocess
import time

__all__ = ["describe_exit", "free_ports", "ports_free", "start", "stop", "stop_with_signal"]


def free_ports(count, host="127.0.0.1"):
    """Returns `count` distinct TCP ports that were free on `host` a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
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
    """True when every port in `ports` can be bound on `host` right now."""
    for port in ports:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        except OSError:
            return False
        finally:
            s.close()
    return True
