"""Which worker slots an elastic job may use now: a fixed list, or a `--host_discovery` command.

A discovery command prints the currently usable hosts, one a line, as Horovod's
discovery script does: `host` (one slot) or `host:slots`. Blank lines and lines
starting with `#` are ignored; a host listed twice counts once, with the larger
of its slot counts (one warning line). It is run at every attempt and every
`--discovery_interval` seconds while a job runs; a command that fails, prints
garbage (a bad line, bytes that are not UTF-8, more than 1 MiB) or is still
running after `--discovery_timeout` seconds is reported in one line and counts as
"nothing usable", so the job waits (up to `--elastic_timeout`) instead of acting
on a guess.

Each call runs in a session (process group) of its own, and the whole group is
SIGKILLed when the call ends, whatever the end: the answer read, the deadline
passed, or the launcher stopping. Nothing the command started outlives the call
(a process that leaves the group with `setsid` escapes, as with task groups).

Hosts whose task failed are cooled down: excluded for `cooldown` seconds after
`strikes` failed attempts in a row (a crashed process on a healthy machine gets
its slot back at once; a machine that keeps failing is left alone for a while).
"""

import os
import re
import selectors
import signal
import subprocess
import time

from tfscale.launch.supervisor import LaunchError

__all__ = ["Cooldown", "Discovery", "DiscoveryCall", "merge_duplicates", "parse_hosts"]

_OUTPUT_LIMIT = 1 << 20  # bytes of stdout one answer may have
_STDERR_TAIL = 4096  # bytes of stderr kept (its last line is reported)
_MAX_SLOTS = 100_000
_HOST_RE = re.compile(r"[A-Za-z0-9_.:%\[\]-]+")
_POLL_SECONDS = 0.05
_MIN_CALL_SECONDS = 1.0  # even when --elastic_timeout is (nearly) over
_SOURCE = "`--host_discovery`"


def parse_hosts(text, source):
    """`[(host, slots), ...]` from `host[:slots]` lines; raises `LaunchError` naming `source`."""
    hosts = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        host, sep, slots = line.rpartition(":") if line.count(":") == 1 else (line, "", "")
        if not sep:
            host, slots = line, "1"
        # ASCII digits only: str.isdigit() takes '²', which int() refuses.
        good = _HOST_RE.fullmatch(host) and re.fullmatch(r"[0-9]{1,6}", slots)
        if not good or int(slots) > _MAX_SLOTS:
            raise LaunchError(
                f"Invalid line from {source}. Received: {line[:200]!r}. Expected `host` or `host:slots` "
                f"(a host name of letters, digits and ._-:[]%, slots 0..{_MAX_SLOTS})."
            )
        hosts.append((host, int(slots)))
    return hosts


def merge_duplicates(hosts):
    """`hosts` with each host once (its largest slot count), and the hosts that were listed twice."""
    merged, repeated = {}, []
    for host, slots in hosts:
        if host in merged:
            repeated.append(host)
        merged[host] = max(slots, merged.get(host, 0))
    return list(merged.items()), list(dict.fromkeys(repeated))


class DiscoveryCall:
    """One run of the discovery command: started at once, read without blocking, bounded.

    `poll()` reads what the command printed; the call is over once the command exited
    (its group is then SIGKILLed, so a child left holding the pipe cannot keep it open),
    printed too much, or passed `deadline` (monotonic seconds). `cancel()` ends it now.
    """

    def __init__(self, command, deadline, expired):
        self._deadline = deadline
        self._expired = expired  # what to say when the deadline passed
        self._proc = subprocess.Popen(
            command,
            shell=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._out, self._err = bytearray(), bytearray()
        self._selector = selectors.DefaultSelector()
        for pipe in (self._proc.stdout, self._proc.stderr):
            os.set_blocking(pipe.fileno(), False)
            self._selector.register(pipe, selectors.EVENT_READ)
        self._exited = False
        self._result = None

    @property
    def pid(self):
        return self._proc.pid

    def poll(self, wait=0.0):
        """Reads for up to `wait` seconds; returns True once the call is over (see `result`)."""
        if self._result is None:
            try:
                self._step(wait)
            except LaunchError as e:
                self._end(e)
        return self._result is not None

    def result(self):
        """The `[(host, slots)]` answered; raises the call's `LaunchError`."""
        if isinstance(self._result, LaunchError):
            raise self._result
        return self._result

    def cancel(self, reason="stopped"):
        """Ends the call now (its whole group SIGKILLed) unless it is over."""
        if self._result is None:
            self._end(LaunchError(f"{_SOURCE} {reason}"))

    def _step(self, wait):
        for key, _ in self._selector.select(timeout=wait if self._selector.get_map() else 0):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                self._selector.unregister(key.fileobj)
            elif key.fileobj is self._proc.stderr:
                self._err = (self._err + chunk)[-_STDERR_TAIL:]
            elif len(self._out) + len(chunk) > _OUTPUT_LIMIT:
                raise LaunchError(f"{_SOURCE} printed more than {_OUTPUT_LIMIT} bytes; stopped it")
            else:
                self._out += chunk
        if not self._exited and _has_exited(self._proc.pid):
            self._exited = True
            # Still a zombie (not reaped), so its group id cannot have been reused.
            _kill_group(self._proc.pid)  # whatever it left behind, holding the pipes or not
        if self._exited and not self._selector.get_map():
            self._end(self._answer())
        elif time.monotonic() >= self._deadline:
            raise LaunchError(f"{_SOURCE} {self._expired}; stopped it")
        elif not self._selector.get_map():
            time.sleep(min(wait, max(0.0, self._deadline - time.monotonic())))

    def _answer(self):
        code = self._proc.wait()
        if code != 0:
            last = (self._err.decode("utf-8", "replace").strip().splitlines() or [""])[-1][:200]
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            return LaunchError(f"{_SOURCE} {how}: {last}".rstrip(": "))
        try:
            text = self._out.decode("utf-8")
        except UnicodeDecodeError as e:
            return LaunchError(
                f"{_SOURCE} printed bytes that are not UTF-8 (at byte {e.start}). "
                "Expected `host[:slots]` lines."
            )
        if "\0" in text:
            return LaunchError(f"{_SOURCE} printed a NUL byte. Expected `host[:slots]` lines.")
        try:
            return parse_hosts(text, _SOURCE)
        except LaunchError as e:
            return e

    def _end(self, result):
        if not self._exited:
            _kill_group(self._proc.pid)  # before reaping the leader: its group id is still ours
        self._proc.wait()  # SIGKILLed or exited: at once
        self._selector.close()
        self._proc.stdout.close()
        self._proc.stderr.close()
        self._result = result if isinstance(result, LaunchError) else list(result)


def _has_exited(pid):
    """Whether `pid` (our child) has exited, without reaping it."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _kill_group(pgid):
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class _Over:
    """A call over at once: the fixed hosts of a `Discovery` without a command, or a failed start."""

    def __init__(self, result):
        self._result = result

    def poll(self, wait=0.0):
        del wait
        return True

    def result(self):
        if isinstance(self._result, LaunchError):
            raise self._result
        return list(self._result)

    def cancel(self, reason="stopped"):
        del reason


class Discovery:
    """Runs the discovery command (`None`: the fixed `hosts` every time).

    Args:
        command: a shell command printing `host[:slots]` lines, or None.
        hosts: `[(host, slots)]` used when `command` is None.
        say: callable for one-line reports (a failed command, a repeated host).
        timeout: seconds one run of the command may take (`--discovery_timeout`).
    """

    def __init__(self, command, hosts, say, timeout=30.0):
        self._command = command
        self._hosts = list(hosts)
        self._say = say
        self._timeout = timeout
        self._last_error = None
        self._last_repeated = []

    def start(self, deadline=None):
        """Starts a call, over after `--discovery_timeout` or at `deadline` (monotonic; at least 1 s)."""
        if self._command is None:
            return _Over(self._hosts)
        now = time.monotonic()
        end, expired = now + self._timeout, f"still running after {self._timeout:g}s"
        if deadline is not None and deadline < end:
            end = max(deadline, now + min(self._timeout, _MIN_CALL_SECONDS))
            expired = "did not answer before --elastic_timeout ran out"
        try:
            return DiscoveryCall(self._command, end, expired)
        except OSError as e:  # no process (EAGAIN, EMFILE, ...): a failed call, not a traceback
            return _Over(LaunchError(f"{_SOURCE} could not start: {e.strerror or e}"))

    def answer(self, call):
        """The usable `[(host, slots)]` of a call that is over (empty when it failed: reported once)."""
        try:
            found = call.result()
        except LaunchError as e:
            if str(e) != self._last_error:  # once per new error, not every poll
                self._say(f"host discovery failed, treating it as no usable hosts: {e}")
            self._last_error = str(e)
            return []
        self._last_error = None
        if self._command is None:
            return found  # `--hosts`: as written
        merged, repeated = merge_duplicates(found)
        if repeated and repeated != self._last_repeated:
            names = ", ".join(repeated[:5]) + (f" and {len(repeated) - 5} more" if len(repeated) > 5 else "")
            self._say(
                f"host discovery listed {names} more than once; counted once with the larger slot count"
            )
        self._last_repeated = repeated
        return merged

    def hosts(self, stop=lambda: False, deadline=None):
        """The usable `[(host, slots)]` now, waiting for the call; None when `stop()` became true."""
        call = self.start(deadline)
        try:
            while not call.poll(_POLL_SECONDS):
                if stop():
                    return None
        finally:
            call.cancel()  # over already, or stopped: its whole group goes
        return self.answer(call)


class Cooldown:
    """Hosts excluded for `seconds` after `strikes` failed attempts in a row."""

    def __init__(self, seconds, strikes=2, clock=time.monotonic):
        self._seconds = seconds
        self._strikes = strikes
        self._clock = clock
        self._count = {}
        self._until = {}

    def failed(self, host):
        """Records a failed task on `host`; returns True when it is now cooling down."""
        self._count[host] = self._count.get(host, 0) + 1
        if self._count[host] >= self._strikes and self._seconds > 0:
            self._until[host] = self._clock() + self._seconds
            self._count[host] = 0
            return True
        return False

    def succeeded(self, hosts):
        """An attempt ran on `hosts` without a failure of theirs: their strikes start over."""
        for host in hosts:
            self._count.pop(host, None)

    def usable(self, hosts):
        """`hosts` (`[(host, slots)]`) without those cooling down."""
        now = self._clock()
        return [(h, s) for h, s in hosts if self._until.get(h, 0) <= now]
