"""Helpers for the `tfscale-launch` tests: run the real binary, find leftover processes."""

import os
import subprocess
import sys
import time
import uuid

__all__ = ["LAUNCHER", "MARKER", "leftovers", "new_marker", "read_until", "run_launcher", "start_launcher"]

# The console script next to this interpreter: the real binary users run.
LAUNCHER = os.path.join(os.path.dirname(sys.executable), "tfscale-launch")
MARKER = "TFSCALE_LAUNCH_TEST_MARKER"


def new_marker():
    return uuid.uuid4().hex


def _env(marker, extra):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    env[MARKER] = marker
    env.update(extra or {})
    return env


def run_launcher(args, marker, *, timeout=120, env=None, cwd=None, prefix=()):
    """Runs `[PREFIX...] tfscale-launch ARGS` to the end; returns the CompletedProcess (text)."""
    return subprocess.run(
        [*prefix, LAUNCHER, *args],
        env=_env(marker, env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def start_launcher(args, marker, *, env=None, cwd=None, merge_stderr=False):
    """Starts `tfscale-launch ARGS` (stdout and stderr piped, or stderr into stdout; text)."""
    return subprocess.Popen(
        [LAUNCHER, *args],
        env=_env(marker, env),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
    )


def _has_marker(pid, needle):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:  # gone, or a zombie / kernel thread
        return False


def leftovers(marker, wait=3.0):
    """Pids of live processes whose environment carries `marker` (after up to `wait` s for exits)."""
    needle = f"{MARKER}={marker}".encode()
    deadline = time.monotonic() + wait
    while True:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
        found = [p for p in pids if _has_marker(p, needle)]
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def read_until(proc, needle, seen, timeout=300):
    """Reads `proc`'s stdout into `seen` up to the first line containing `needle`; returns it.

    A line not seen within `timeout` (checked between lines; the test's own pytest timeout
    bounds a process that goes silent) or the output's end fails with the output's tail.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if needle in line:
            return line
    raise AssertionError(f"{needle!r} not seen; output ends with:\n{''.join(seen[-60:])}")
