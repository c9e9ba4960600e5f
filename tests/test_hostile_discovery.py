"""Hostile `--host_discovery` scripts: they hang, flap, lie, repeat and fail; the launcher must not.

The cases are generated from families of real shell scripts. Every script appends its own pid
and its children's to a file; each case runs the real `tfscale-launch` in a session of its own
with a time bound, and once it exited checks from this process (another process group) that
none of those pids is alive, and that no process carrying the case's marker is left. What
each family must give:

* hang: a script that never answers (children, SIGTERM ignored, a grandchild, an answer
  printed but never finished) is killed with its whole group at `--elastic_timeout` (the
  reported wait is the measured one) or at `--discovery_timeout`; SIGTERM to the launcher
  ends it within seconds whether it is waiting for hosts or running tasks;
* flap: an answer that changes at every call resizes nothing (a grow must hold for
  `--resize_cooldown`);
* lie: bad lines, bytes that are not UTF-8, a NUL, endless or huge output, negative or
  Unicode slot counts are one line (once) and count as "nothing usable"; zero slots are
  no slots; a host that does not exist fails its tasks until it is cooled down;
* repeat: a host listed several times counts once, with one warning line;
* exit: a script that fails (a code, a signal) is one line and "nothing usable".
"""

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _launch_util import LAUNCHER, MARKER, leftovers, new_marker

# A cheap task: prints the job's size and worker index, then sleeps `$SLEEP` seconds (SIGTERM: 75).
# With `$STUCK` it ignores SIGTERM (a backup that never ends); with `$FAIL_FIRST` the first attempt fails.
TASK = (
    "import json, os, signal, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN if os.environ.get('STUCK') else lambda *a: sys.exit(75))\n"
    "c = json.loads(os.environ['TF_CONFIG'])\n"
    "print('size', len(c['cluster']['worker']), 'index', c['task']['index'], flush=True)\n"
    "if os.environ.get('FAIL_FIRST') and os.environ['TFSCALE_RESTART_COUNT'] == '0':\n"
    "    sys.exit(1)\n"
    "time.sleep(float(os.environ.get('SLEEP', '0')))\n"
)
QUICK = ["--discovery_interval", "0.1", "--restart_backoff", "0.1", "--grace_period", "2"]


class Case:
    """One launcher run on a generated discovery script."""

    def __init__(self, tmp_path, body):
        self.dir = tmp_path
        self.pids = tmp_path / "pids"
        self.calls = tmp_path / "calls"
        self.script = tmp_path / "discover.sh"
        # Every call counts itself (CALL=1, 2, ...) and records its pid before anything else.
        preamble = (
            f'echo $$ >> "{self.pids}"\n'
            f'echo x >> "{self.calls}"\nCALL=$(wc -l < "{self.calls}")\n'
            f'PIDS="{self.pids}"\n'
        )
        self.script.write_text("#!/bin/sh\n" + preamble + textwrap.dedent(body))
        self.script.chmod(0o755)
        self.marker = new_marker()
        self.proc = None
        self.elapsed = None

    def start(self, flags, sleep=0.0, **task_env):
        env = dict(os.environ, PYTHONUNBUFFERED="1", SLEEP=str(sleep), **{MARKER: self.marker}, **task_env)
        self.started, self.started_uptime, self.ended = time.monotonic(), _uptime(), None
        self.proc = subprocess.Popen(
            [LAUNCHER, "--host_discovery", str(self.script), *flags, "--", sys.executable, "-c", TASK],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # the checks below run from another process group
        )
        return self

    def wait_for(self, what, count, bound=20.0):
        """Waits (bounded) until the script made `count` calls (`what="calls"`) or recorded `count` pids."""
        path = self.calls if what == "calls" else self.pids
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            if path.exists() and len(path.read_text().split()) >= count:
                return
            time.sleep(0.05)
        raise AssertionError(f"the discovery script did not reach {count} {what} in {bound:g}s")

    def read_until(self, needle, bound=30.0):
        """Reads the launcher's output up to a line containing `needle` (bounded by `bound` s)."""
        deadline, seen = time.monotonic() + bound, []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline().decode("utf-8", "replace")
            seen.append(line)
            if needle in line:
                return
            if not line:
                break
        self._clean_up()
        raise AssertionError(f"{needle!r} not seen:\n{''.join(seen)[-3000:]}")

    def finish(self, bound):
        """The launcher's exit status and output; it must end within `bound` seconds."""
        try:
            out, _ = self.proc.communicate(timeout=bound)
        except subprocess.TimeoutExpired:
            self._clean_up()
            out, _ = self.proc.communicate(timeout=30)
            tail = out.decode()[-3000:]
            raise AssertionError(f"the launcher was still running after {bound:g}s:\n{tail}") from None
        finally:
            self.elapsed = time.monotonic() - self.started
            self.ended = _uptime()
        self.output = out.decode("utf-8", "replace")
        assert "Traceback" not in self.output, self.output[-3000:]
        alive = self._alive()
        if alive:
            self._clean_up()
        assert alive == [], f"left running after the launcher exited: {alive}\n{self.output[-2000:]}"
        return self.proc.returncode, self.output

    def _recorded(self):
        """The live pids the script recorded that are still its processes.

        pid_max is 32768 here and the suite's TensorFlow processes spend pids fast (a thread
        takes one too), so a recorded pid can name a newer process or thread by the time it
        is checked: seen once, the script's leader, reaped by the launcher before it exited,
        read as alive. A pid counts only while it names a process started within the case.
        """
        if not self.pids.exists():
            return []
        end = self.ended if self.ended is not None else _uptime()
        return [
            p for p in map(int, self.pids.read_text().split()) if _started_within(p, self.started_uptime, end)
        ]

    def _alive(self):
        alive = [p for p in self._recorded() if _is_alive(p)]
        return sorted(set(alive + leftovers(self.marker, wait=1.0)))

    def _clean_up(self):
        """SIGKILLs what this case started (its recorded pids, its marker): a failed case leaves nothing."""
        for pid in [self.proc.pid, *self._recorded(), *leftovers(self.marker, wait=0)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _uptime():
    with open("/proc/uptime") as f:
        return float(f.read().split()[0])


def _started_within(pid, begin, end):
    """Whether `pid` is a process (not another process's thread) started between `begin` and
    `end` (seconds since boot, one clock tick of slack)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            if f"Tgid:\t{pid}\n" not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return False
    tick = 1 / os.sysconf("SC_CLK_TCK")
    return begin - tick <= started <= end + tick


def _is_alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _sigterm(case, bound):
    """SIGTERM to the launcher: it must exit 143 within `bound` seconds."""
    sent = time.monotonic()
    case.proc.send_signal(signal.SIGTERM)
    code, output = case.finish(bound + 30)
    took = time.monotonic() - sent
    assert code == 128 + signal.SIGTERM, output[-2000:]
    assert took < bound, f"SIGTERM took {took:.1f}s to end the launcher (bound {bound:g}s)"
    return output


# --- hang -------------------------------------------------------------------------------------

_CHILDREN = """
sleep 600 & echo $! >> "$PIDS"
sleep 600 & echo $! >> "$PIDS"
"""
HANG = {
    "sleeps": 'sleep 600 & echo $! >> "$PIDS"\nwait\n',
    "children": _CHILDREN + "wait\n",
    "ignores_sigterm": "trap '' TERM HUP INT\n" + _CHILDREN + "wait\n",
    "grandchild": 'sh -c \'sleep 600 & echo $! >> "$0"; wait\' "$PIDS" & echo $! >> "$PIDS"\nwait\n',
    "answer_never_finished": "echo localhost:2\n" + _CHILDREN + "wait\n",
}
_ALL_HANG = list(HANG)


def _families(names, fast):
    return [pytest.param(n, marks=() if n in fast else pytest.mark.slow) for n in names]


@pytest.mark.parametrize("hang", _families(_ALL_HANG, ("children",)))
def test_hanging_discovery_ends_at_the_elastic_timeout_with_the_true_wait(hang, tmp_path):
    case = Case(tmp_path, HANG[hang]).start(["--num_workers", "1:2", "--elastic_timeout", "2", *QUICK])
    code, output = case.finish(bound=12)
    assert code == 1, output[-2000:]
    last = output.splitlines()[-1]
    assert re.fullmatch(
        r"tfscale-launch: job failed: 0 usable worker slots, --num_workers 1:2 needs at least 1 "
        r"\(waited (\d+\.\d)s, --elastic_timeout 2s\)",
        last,
    ), last
    waited = float(re.search(r"waited ([\d.]+)s", last).group(1))
    assert 2.0 <= waited <= case.elapsed + 0.1  # what it says is what it did
    assert "`--host_discovery` did not answer before --elastic_timeout ran out; stopped it" in output


@pytest.mark.parametrize("hang", _families(_ALL_HANG, ("ignores_sigterm",)))
def test_sigterm_ends_a_launcher_waiting_on_a_hanging_discovery_within_seconds(hang, tmp_path):
    case = Case(tmp_path, HANG[hang]).start(["--num_workers", "1:2", "--elastic_timeout", "600", *QUICK])
    case.wait_for("calls", 1)
    _sigterm(case, bound=3)


def test_sigterm_ends_a_running_job_whose_discovery_poll_hangs_within_seconds(tmp_path):
    # The first call answers; every later one (the polls while the job runs) hangs.
    body = 'if [ "$CALL" -eq 1 ]; then echo localhost:1; exit 0; fi\n' + HANG["ignores_sigterm"]
    case = Case(tmp_path, body).start(["--num_workers", "1:2", *QUICK], sleep=600)
    case.wait_for("pids", 4)  # the first call, the second and its two children: the poll hangs
    output = _sigterm(case, bound=2 + 3)  # --grace_period 2 for the task, which exits at once
    assert "[worker:0] size 1 index 0" in output


def test_an_answer_whose_script_left_a_child_holding_the_pipe_is_used_and_the_child_killed(tmp_path):
    body = 'echo localhost:1\n(sleep 600 & echo $! >> "$PIDS"; wait) &\nexit 0\n'
    case = Case(tmp_path, body).start(["--num_workers", "1:2", "--elastic_timeout", "20", *QUICK])
    code, output = case.finish(bound=10)
    assert code == 0, output[-2000:]
    assert "[worker:0] size 1 index 0" in output and "host discovery failed" not in output


def test_sigterm_during_a_resize_backup_that_never_ends_takes_grace_period_not_the_resize_grace(tmp_path):
    body = 'if [ "$CALL" -eq 1 ]; then echo localhost:1; else echo localhost:2; fi\n'
    flags = ["--num_workers", "1:2", "--resize_cooldown", "0.2", *QUICK]
    case = Case(tmp_path, body).start(flags, sleep=600, STUCK="1")
    case.read_until("asking every task to back up and stop (SIGTERM) to grow")
    _sigterm(case, bound=2 + 3)  # --grace_period 2, then SIGKILL; not the 120 s a resize's backup gets


@pytest.mark.slow
def test_sigterm_during_the_restart_backoff_ends_the_launcher_at_once(tmp_path):
    flags = ["--num_workers", "1:2", "--max_restarts", "1", *QUICK, "--restart_backoff", "600"]
    case = Case(tmp_path, "echo localhost:1\n").start(flags, FAIL_FIRST="1")
    case.read_until("restarting the job on the usable slots (restart 1 of 1) in 600s")
    _sigterm(case, bound=3)


def test_a_hanging_discovery_call_is_killed_at_discovery_timeout_and_the_next_answer_used(tmp_path):
    body = 'if [ "$CALL" -eq 1 ]; then\n' + HANG["ignores_sigterm"] + "fi\necho localhost:1\n"
    case = Case(tmp_path, body).start(
        ["--num_workers", "1:2", "--elastic_timeout", "20", "--discovery_timeout", "1", *QUICK]
    )
    code, output = case.finish(bound=10)
    assert code == 0, output[-2000:]
    assert "treating it as no usable hosts: `--host_discovery` still running after 1s; stopped it" in output
    assert "[worker:0] size 1 index 0" in output


# --- flap -------------------------------------------------------------------------------------

FLAP = {
    "every_call": "if [ $((CALL % 2)) -eq 1 ]; then echo localhost:2; else echo localhost:3; fi\n",
    "every_call_with_a_failure": "case $((CALL % 3)) in 0) exit 1;; 1) echo localhost:2;; "
    "*) echo localhost:3;; esac\n",
    "up_and_down_by_one_host": "echo localhost:2\nif [ $((CALL % 2)) -eq 0 ]; then echo 127.0.0.2:1; fi\n",
}


@pytest.mark.parametrize("flap", _families(list(FLAP), ("every_call",)))
def test_flapping_discovery_does_not_resize_the_job(flap, tmp_path):
    # 4 s of a job whose discovery changes its answer every 0.1 s: before, a resize or more a second.
    case = Case(tmp_path, FLAP[flap]).start(["--num_workers", "2:3", *QUICK], sleep=4)
    code, output = case.finish(bound=30)
    assert code == 0, output[-2000:]
    assert output.count("elastic: running ") == 1, output[-3000:]  # the start, no resize
    assert "asking every task to back up" not in output


@pytest.mark.slow  # test_elastic's fast grow test covers the grow itself
def test_an_answer_that_holds_for_the_cooldown_grows_the_job_once(tmp_path):
    # 2 slots at the first call, 3 from then on: one grow, after --resize_cooldown.
    body = 'if [ "$CALL" -eq 1 ]; then echo localhost:2; else echo localhost:3; fi\n'
    case = Case(tmp_path, body).start(["--num_workers", "2:3", "--resize_cooldown", "1", *QUICK], sleep=4)
    code, output = case.finish(bound=40)
    assert code == 0, output[-2000:]
    assert output.count("asking every task to back up and stop (SIGTERM) to grow") == 1
    assert re.search(
        r"elastic: running from 2 to 3 workers \(3 usable worker slots for (1\.\d|2\.0)s, the job ran on 2\)",
        output,
    ), output[-3000:]


# --- lie --------------------------------------------------------------------------------------

LIE = {
    "not_a_number": "echo localhost:two\n",
    "negative_slots": "echo localhost:-1\n",
    "unicode_digit_slots": "printf 'localhost:\\262\\n'\n",  # '²' in Latin-1: also not UTF-8
    "superscript_slots": "printf 'localhost:\\302\\262\\n'\n",  # '²' in UTF-8: isdigit() but not int()
    "space_in_host": "echo 'local host:1'\n",
    "escape_in_host": "printf 'localhost\\033[2J:1\\n'\n",
    "not_utf8": "printf '\\377\\376localhost:1\\n'\n",
    "nul_byte": "printf 'localhost\\000:1\\n'\n",
    "endless": "yes localhost:1\n",
    "huge_line": "head -c 3000000 /dev/zero | tr '\\0' x\n",
    "too_many_slots": "echo localhost:99999999999999999999\n",
}


@pytest.mark.parametrize("lie", _families(list(LIE), ("not_utf8", "endless")))
def test_discovery_that_prints_garbage_is_one_line_and_nothing_usable(lie, tmp_path):
    case = Case(tmp_path, LIE[lie]).start(["--num_workers", "1:2", "--elastic_timeout", "1", *QUICK])
    code, output = case.finish(bound=15)
    assert code == 1, output[-2000:]
    failures = [x for x in output.splitlines() if "host discovery failed" in x]
    assert len(failures) == 1, output[-3000:]  # once, not once a poll
    assert len(failures[0]) < 600
    assert output.splitlines()[-1].startswith("tfscale-launch: job failed: 0 usable worker slots")


@pytest.mark.slow
def test_zero_slots_are_no_slots(tmp_path):
    case = Case(tmp_path, "echo localhost:0\n").start(
        ["--num_workers", "1:2", "--elastic_timeout", "1", *QUICK]
    )
    code, output = case.finish(bound=15)
    assert code == 1 and "host discovery failed" not in output, output[-2000:]
    assert output.splitlines()[-1].startswith("tfscale-launch: job failed: 0 usable worker slots")


@pytest.mark.slow
def test_a_host_that_does_not_exist_fails_its_tasks_until_it_is_cooled_down(tmp_path):
    # The "remote" starter resolves the host first, as ssh does (exit 255 when it cannot).
    remote = 'sh -c \'getent hosts "$0" > /dev/null || exit 255; exec "$@"\' {host}'
    case = Case(tmp_path, "echo localhost:1\necho no-such-host.invalid:1\n").start(
        ["--num_workers", "1:2", "--max_restarts", "2", "--remote_cmd", remote, *QUICK]
    )
    code, output = case.finish(bound=30)
    assert code == 0, output[-3000:]
    assert output.count("tfscale-launch: worker:1 failed (exit code 255) in attempt") == 2
    assert "elastic: no-such-host.invalid failed twice in a row; left out for a cool-down" in output
    assert "job succeeded in attempt 3 on 1 workers" in output


# --- repeat -----------------------------------------------------------------------------------

REPEAT = {
    "twice": ("echo localhost:1\necho localhost:1\n", 1),
    "larger_second": ("echo localhost:1\necho localhost:2\n", 2),
    "a_thousand_times": ("yes localhost:1 | head -n 1000\n", 1),
    "among_others": ("echo localhost:1\necho 127.0.0.1:1\necho localhost:1\n", 2),
}


@pytest.mark.parametrize("repeat", _families(list(REPEAT), ("twice",)))
def test_a_host_listed_several_times_counts_once_with_one_warning(repeat, tmp_path):
    body, size = REPEAT[repeat]
    case = Case(tmp_path, body).start(["--num_workers", "1:3", *QUICK], sleep=1)
    code, output = case.finish(bound=20)
    assert code == 0, output[-2000:]
    assert f"elastic: running at {size} worker" in output, output[-2000:]
    warnings = [x for x in output.splitlines() if "more than once" in x]
    assert warnings == [
        "tfscale-launch: host discovery listed localhost more than once; counted once with the larger "
        "slot count"
    ], output[-2000:]


# --- exit -------------------------------------------------------------------------------------

EXIT = {
    "code": ("echo 'inventory service down' >&2\nexit 3\n", "exited with code 3: inventory service down"),
    "code_after_an_answer": ("echo localhost:2\nexit 1\n", "exited with code 1"),
    "killed": ("kill -KILL $$\n", "exited with code 137"),  # as `sh -c` reports its script's SIGKILL
    "not_found": ("exec /nonexistent/discover\n", "exited with code 127"),
}


@pytest.mark.parametrize("exit_kind", _families(list(EXIT), ("code",)))
def test_failing_discovery_is_one_line_and_nothing_usable(exit_kind, tmp_path):
    body, reason = EXIT[exit_kind]
    case = Case(tmp_path, body).start(["--num_workers", "1:2", "--elastic_timeout", "1", *QUICK])
    code, output = case.finish(bound=15)
    assert code == 1, output[-2000:]
    failures = [x for x in output.splitlines() if "host discovery failed" in x]
    assert len(failures) == 1 and reason in failures[0], output[-2000:]
