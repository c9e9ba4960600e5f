"""Which worker slots an elastic job may use now: a fixed list, or a `--host_discovery` command.

A discovery command prints the currently usable hosts, one a line, as Horovod's
discovery script does: `host` (one slot) or `host:slots`. Blank lines and lines
starting with `#` are ignored. It is run again at every attempt and every
`--discovery_interval` seconds while a job runs; a command that fails or prints
garbage is reported in one line and counts as "nothing usable", so the job waits
(up to `--elastic_timeout`) instead of acting on a guess.

Hosts whose task failed are cooled down: excluded for `cooldown` seconds after
`strikes` failed attempts in a row (a crashed process on a healthy machine gets
its slot back at once; a machine that keeps failing is left alone for a while).
"""

import subprocess
import time

from tfscale.launch.supervisor import LaunchError

__all__ = ["Cooldown", "Discovery", "parse_hosts"]

_COMMAND_TIMEOUT = 30.0


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
        if not host or not slots.isdigit():
            raise LaunchError(
                f"Invalid line from {source}. Received: {line!r}. Expected `host` or `host:slots`."
            )
        hosts.append((host, int(slots)))
    return hosts


class Discovery:
    """Runs the discovery command (`None`: the fixed `hosts` every time).

    Args:
        command: a shell command printing `host[:slots]` lines, or None.
        hosts: `[(host, slots)]` used when `command` is None.
        say: callable for one-line reports (a failed command).
    """

    def __init__(self, command, hosts, say):
        self._command = command
        self._hosts = list(hosts)
        self._say = say
        self._last_error = None

    def hosts(self):
        """The usable `[(host, slots)]` now (empty when the command failed)."""
        if self._command is None:
            return list(self._hosts)
        try:
            proc = subprocess.run(
                self._command,
                shell=True,
                capture_output=True,
                text=True,
                timeout=_COMMAND_TIMEOUT,
                check=False,
                start_new_session=True,
            )
            if proc.returncode != 0:
                raise LaunchError(
                    f"`--host_discovery` exited with code {proc.returncode}: "
                    f"{(proc.stderr.strip().splitlines() or [''])[-1]}"
                )
            found = parse_hosts(proc.stdout, "`--host_discovery`")
        except (LaunchError, subprocess.TimeoutExpired, OSError) as e:
            if str(e) != self._last_error:  # once per new error, not every poll
                self._say(f"host discovery failed, treating it as no usable hosts: {e}")
            self._last_error = str(e)
            return []
        self._last_error = None
        return found


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
