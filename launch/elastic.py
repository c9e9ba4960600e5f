"""Elastic jobs: `tfscale-launch --num_workers MIN:MAX [--host_discovery CMD] -- COMMAND`.

The job runs on as many workers as are usable, between MIN and MAX:

* before every attempt the launcher asks which slots are usable (the discovery
  command, else the fixed `--hosts`/`--hostfile`, else MAX slots on this host),
  drops hosts that are cooling down after failing twice in a row, and starts
  `min(usable, MAX)` workers; with fewer than MIN it waits up to
  `--elastic_timeout` seconds, then fails with one line;
* a failed task fails the attempt as without elasticity (counted against
  `--max_restarts`); the next attempt uses the slots usable then, so a lost host
  shrinks the job instead of failing every restart;
* while the job runs, discovery is polled every `--discovery_interval` seconds
  (without blocking: a poll that hangs delays no exit and no signal); when it has
  shown more usable slots on every poll for `--resize_cooldown` seconds (and the
  job is below MAX) the launcher asks every task to back up and stop (SIGTERM:
  `BackupAndRestore` saves at the next step and exits with 75) and restarts the
  job larger. This is not a failure. The hold is counted from the attempt's
  start, so a job grows at most once per `--resize_cooldown`, and an answer that
  flaps never grows it.

One discovery call runs at most `--discovery_timeout` seconds (its whole process
group is then SIGKILLed), and a wait for MIN slots at most `--elastic_timeout`
seconds, discovery included (but for its first call). SIGTERM, SIGINT or SIGHUP
ends the launcher within `--grace_period` seconds in every state, a resize's
backup included.

Every change of size is logged with its reason and the new TF_CONFIGs. Tasks see
`TFSCALE_ELASTIC_WORKERS=MIN:MAX` and `TFSCALE_ELASTIC_BATCH=global|per_replica`
(see `tfscale/_task_protocol.py` for what `tfscale-train` does with them).

Workers only: a chief, parameter servers or an evaluator make no sense in a job
whose size changes (`MultiWorkerMirroredStrategy` is the elastic strategy).
"""

import math
import os
import signal
import socket
import time

from absl import flags

from tfscale._task_protocol import (
    ELASTIC_BATCH_MODES,
    ELASTIC_BATCH_VAR,
    ELASTIC_WORKERS_VAR,
    ElasticBatch,
    WorkerRange,
    check_global_batch,
    elastic_batch,
    parse_num_workers,
)
from tfscale.launch import _discovery, _remote, jobs, supervisor
from tfscale.launch.supervisor import Failure, LaunchError, LaunchResult

__all__ = [
    "ELASTIC_BATCH_VAR",
    "ELASTIC_WORKERS_VAR",
    "ElasticBatch",
    "ElasticJob",
    "ElasticSupervisor",
    "WorkerRange",
    "check_global_batch",
    "define_flags",
    "define_num_workers",
    "elastic_batch",
    "main",
    "requested",
]

_LOCAL_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")
# Seconds the tasks get to back up and exit after the launcher asked them to (a grow).
_RESIZE_GRACE = 120.0
_POLL_SECONDS = 0.05


class _NumWorkersParser(flags.ArgumentParser):
    def parse(self, argument):
        return parse_num_workers(argument) if not isinstance(argument, (int, WorkerRange)) else argument

    def flag_type(self):
        return "N or MIN:MAX"


def define_num_workers(fv):
    """`--num_workers N` (fixed) or `MIN:MAX` (elastic); the value is an int or a `WorkerRange`."""
    flags.DEFINE(
        _NumWorkersParser(),
        "num_workers",
        None,
        "Worker tasks on this host (default 1), or MIN:MAX for an elastic job.",
        flag_values=fv,
    )


def define_flags(fv):
    """The elastic flags of `tfscale-launch` (besides `--num_workers MIN:MAX`)."""
    flags.DEFINE_string(
        "host_discovery", None, "Command printing the usable `host[:slots]` lines (elastic).", flag_values=fv
    )
    flags.DEFINE_enum(
        "elastic_batch",
        "global",
        ELASTIC_BATCH_MODES,
        "On a size change keep the global batch, or the per-replica batch (learning rate rescaled).",
        flag_values=fv,
    )
    flags.DEFINE_float(
        "elastic_timeout", 600.0, "Seconds to wait for MIN usable workers.", lower_bound=0, flag_values=fv
    )
    flags.DEFINE_float(
        "discovery_interval", 5.0, "Seconds between discovery polls.", lower_bound=0.01, flag_values=fv
    )
    flags.DEFINE_float(
        "host_cooldown",
        300.0,
        "Seconds a host that failed twice in a row is left out.",
        lower_bound=0,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "discovery_timeout",
        30.0,
        "Seconds one run of --host_discovery may take; then its process group is killed.",
        lower_bound=0.01,
        flag_values=fv,
    )
    flags.DEFINE_float(
        "resize_cooldown",
        30.0,
        "Seconds discovery must show more usable slots on every poll before the job grows.",
        lower_bound=0,
        flag_values=fv,
    )
    names = ("elastic_timeout", "discovery_interval", "host_cooldown", "discovery_timeout", "resize_cooldown")
    for name in names:
        # lower_bound lets nan and inf through (nan fails no comparison).
        flags.register_validator(
            name, lambda v: v < float("inf"), f"--{name} expects a finite number of seconds.", flag_values=fv
        )


def requested(fv):
    """True when the flags ask for an elastic job."""
    return isinstance(fv.num_workers, WorkerRange) or fv.host_discovery is not None


def _is_local(host):
    return host in _LOCAL_NAMES or host.startswith("127.") or host == socket.gethostname()


def _choose(hosts, maximum):
    """The first hosts of `hosts` with their slots, cut to `maximum` slots in all."""
    chosen, total = [], 0
    for host, slots in hosts:
        take = min(slots, maximum - total)
        if take > 0:
            chosen.append((host, take))
            total += take
    return chosen


class ElasticJob:
    """The tasks of one attempt on the hosts chosen for it (`world`).

    A world of local hosts only runs as a `LocalJob` (free loopback ports), any
    other as a `HostsJob` through `remote_cmd`.
    """

    def __init__(self, command, *, worker_range, batch_mode, keras_compat, port, remote_cmd, environ=None):
        self.command = jobs._check_command(command)
        base = dict(os.environ if environ is None else environ)
        self._environ = dict(base, **{ELASTIC_WORKERS_VAR: str(worker_range), ELASTIC_BATCH_VAR: batch_mode})
        self._keras_compat = keras_compat
        self._port = port
        self._remote_cmd = remote_cmd
        jobs._check_program(self.command[0], self._environ)
        self.world = []
        self._job = None
        self._hosts_of_tasks = {}

    @property
    def size(self):
        return sum(slots for _, slots in self.world)

    def use(self, world):
        """Makes the next attempts run on `world` (`[(host, slots)]`)."""
        self.world = list(world)
        if all(_is_local(h) for h, _ in self.world):
            self._job = jobs.LocalJob(
                self.command, self.size, keras_compat=self._keras_compat, environ=self._environ
            )
            self._hosts_of_tasks = {}
        else:
            entries = [f"{h}:{s}" for h, s in self.world]
            # The remote side gets only TF_CONFIG and the restart count: pass ours by `env`.
            elastic_vars = [f"{k}={self._environ[k]}" for k in (ELASTIC_WORKERS_VAR, ELASTIC_BATCH_VAR)]
            self._job = jobs.HostsJob(
                ["env", *elastic_vars, *self.command],
                entries,
                port=self._port,
                remote_cmd=self._remote_cmd,
                keras_compat=self._keras_compat,
                environ=self._environ,
            )
            names = [h for h, s in self.world for _ in range(s)]
            self._hosts_of_tasks = {f"worker:{i}": h for i, h in enumerate(names)}

    def tf_config(self, index):
        """The TF_CONFIG of worker `index` in the last attempt built."""
        return self._job.spec.to_json("worker", index)

    def host_of(self, task_name):
        """The (remote) host a task ran on, or None for a local job."""
        return self._hosts_of_tasks.get(task_name)

    def __call__(self, attempt):
        return self._job(attempt)


class ElasticSupervisor(supervisor.Supervisor):
    """A `Supervisor` whose attempts run on the slots usable at the time, between MIN and MAX.

    Args:
        job: an `ElasticJob`.
        discovery: a `_discovery.Discovery`.
        worker_range: the `WorkerRange`.
        elastic_timeout: seconds to wait for `worker_range.minimum` usable slots.
        discovery_interval: seconds between discovery polls.
        host_cooldown: seconds a host that failed twice in a row is left out.
        resize_cooldown: seconds more usable slots must show on every poll before a grow.
        **options: the `Supervisor` options.
    """

    def __init__(
        self,
        job,
        discovery,
        *,
        worker_range,
        elastic_timeout,
        discovery_interval,
        host_cooldown,
        resize_cooldown=30.0,
        **options,
    ):
        super().__init__(self._tasks, **options)
        self._job = job
        self._discovery = discovery
        self._range = worker_range
        self._timeout = elastic_timeout
        self._interval = discovery_interval
        self._cooldown = _discovery.Cooldown(host_cooldown)
        self._hold = resize_cooldown
        self._stop_grace = self._grace  # what a signal cuts a resize's longer grace to
        self._resizes = 0
        self._grow = None
        self._log_configs = False
        self._procs = {}
        self._poll = None  # the discovery call in flight while an attempt runs
        self._next_poll = discovery_interval
        self._larger = None  # (since, smallest size) of the polls showing more slots, in a row

    def _tasks(self, attempt):
        tasks = self._job(attempt)
        if self._log_configs:
            self._log_configs = False
            for index in range(self._job.size):
                self._say(f"  worker:{index} TF_CONFIG={self._job.tf_config(index)}")
        return tasks

    def _world_of(self, hosts):
        return _choose(self._cooldown.usable(hosts), self._range.maximum)

    def _wait_for_world(self):
        """The world of the next attempt, or None (timed out: reported; or a signal).

        The wait ends at `--elastic_timeout`, a discovery call in flight included (it is
        killed then; a call gets at least 1 s).
        """
        started = time.monotonic()
        deadline, first = started + self._timeout, True
        while not self._signal:
            hosts = self._discovery.hosts(stop=lambda: self._signal, deadline=deadline)
            if hosts is None:
                return None  # a signal
            world = self._world_of(hosts)
            size = sum(s for _, s in world)
            if size >= self._range.minimum:
                return world
            waited = time.monotonic() - started
            if waited >= self._timeout:
                self._say(
                    f"job failed: {size} usable worker slot{'s' if size != 1 else ''}, "
                    f"--num_workers {self._range} needs at least {self._range.minimum} "
                    f"(waited {math.floor(waited * 10) / 10:.1f}s, --elastic_timeout {self._timeout:g}s)"
                )
                return None
            if first:
                self._say(
                    f"waiting for {self._range.minimum} usable worker slots ({size} now), "
                    f"up to {self._timeout:g}s"
                )
            first = False
            self._sleep(min(self._interval, deadline - time.monotonic()))
        return None

    def _use(self, world, reason):
        before = self._job.size
        self._job.use(world)
        placement = ", ".join(f"{h}:{s}" for h, s in world)
        if before != self._job.size:
            change = f"from {before} to {self._job.size}" if before else f"at {self._job.size}"
            plural = "s" if self._job.size > 1 else ""
            self._say(f"elastic: running {change} worker{plural} ({reason}) on {placement}")
            self._log_configs = True

    def _run_attempts(self):
        failures, attempt, reason = [], 0, "start"
        while True:
            world = self._wait_for_world()
            if world is None:
                return LaunchResult(False, attempt, tuple(failures), self._signal)
            self._use(world, reason)
            attempt += 1
            self._grow, self._procs = None, {}
            failure = self._run_attempt(attempt, self._max_restarts + 1 + self._resizes)
            if self._signal:
                name = signal.Signals(self._signal).name
                self._say(f"stopped by {name}: forwarded it to every task (attempt {attempt})")
                return LaunchResult(False, attempt, tuple(failures), self._signal)
            if self._grow is not None:
                exits = ", ".join(f"{n} {_describe(p.returncode)}" for n, p in self._procs.items())
                self._say(f"elastic: tasks stopped for the resize ({exits})")
                self._resizes, reason = self._resizes + 1, self._grow
                continue
            if failure is None:
                if attempt > 1:
                    self._say(f"job succeeded in attempt {attempt} on {self._job.size} workers")
                return LaunchResult(True, attempt, tuple(failures))
            failures.append(failure)
            self._strike(failure)
            if len(failures) > self._max_restarts:
                self._say(
                    f"job failed: {failure}; no restarts left (--max_restarts={self._max_restarts}, "
                    f"{attempt} attempts made)"
                )
                return LaunchResult(False, attempt, tuple(failures))
            self._say(
                f"{failure}; restarting the job on the usable slots (restart {len(failures)} of "
                f"{self._max_restarts}) in {self._backoff:g}s"
            )
            reason = str(failure)
            self._sleep(self._backoff)
            if self._signal:
                return LaunchResult(False, attempt, tuple(failures), self._signal)

    def _strike(self, failure):
        host = self._job.host_of(failure.task)
        others = {h for h, _ in self._job.world} - {host}
        self._cooldown.succeeded(others)
        if host is not None and self._cooldown.failed(host):
            self._say(f"elastic: {host} failed twice in a row; left out for a cool-down")

    def _start(self, task):
        proc = super()._start(task)
        self._procs[task.name] = proc
        return proc

    def _hang_rule(self, attempt, elapsed, first_done, waiting, running, pump):  # noqa: PLR0917
        failure = super()._hang_rule(attempt, elapsed, first_done, waiting, running, pump)
        below_max = self._job.size < self._range.maximum
        if failure is not None or first_done is not None or len(running) < len(self._procs) or not below_max:
            self._drop_poll()  # no grow now: the call is not needed
            return failure
        if self._poll is None:
            if elapsed >= self._next_poll:
                self._poll = self._discovery.start()
            return None
        if not self._poll.poll():
            return None  # still running: looked at again in 50 ms; its deadline bounds it
        size = sum(s for _, s in self._world_of(self._discovery.answer(self._poll)))
        self._poll, self._next_poll = None, elapsed + self._interval
        return self._maybe_grow(attempt, size)

    def _maybe_grow(self, attempt, size):
        """A `Failure` asking for a grow once `size` > the job's size held for `--resize_cooldown`."""
        now = time.monotonic()
        if size <= self._job.size:
            self._larger = None  # the hold starts over
            return None
        since, smallest = self._larger or (now, size)
        self._larger = (since, min(smallest, size))
        if since == now or now - since < self._hold:
            return None  # not held long enough (two polls at least must agree)
        self._grow = (
            f"{self._larger[1]} usable worker slots for {now - since:.1f}s, the job ran on {self._job.size}"
        )
        self._say(f"elastic: {self._grow}: asking every task to back up and stop (SIGTERM) to grow")
        # The attempt ends like a failure, but the tasks get time to back up, and it is not counted.
        self._grace = max(self._grace, _RESIZE_GRACE)
        return Failure(attempt, "launcher", "resize")

    def _hurry(self):
        """A signal during a resize's long grace cuts it to `--grace_period`."""
        return self._stop_grace if self._signal else None

    def _run_attempt(self, attempt, total):
        grace, self._next_poll, self._larger = self._grace, self._interval, None
        try:
            return super()._run_attempt(attempt, total)
        finally:
            self._grace = grace
            self._drop_poll()  # its whole group: nothing it started outlives the attempt

    def _drop_poll(self):
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None


def _describe(code):
    from tfscale.launch import _procs

    return _procs.describe_exit(code)


def _world_from_flags(fv, worker_range):
    if fv.hosts is not None or fv.hostfile is not None:
        if fv.hosts is not None and fv.hostfile is not None:
            raise LaunchError("Invalid flags: expected at most one of `--hosts` and `--hostfile`.")
        if fv.hostfile is not None:
            from tfscale.cluster import ClusterSpec

            workers = ClusterSpec.from_hostfile(fv.hostfile, port=fv.port).cluster["worker"]
            names = [_remote.host_of(w) for w in workers]
            return [(h, names.count(h)) for h in dict.fromkeys(names)]
        return _discovery.parse_hosts("\n".join(fv.hosts), "`--hosts`")
    return [("localhost", worker_range.maximum)]


def main(fv, command, say=None):
    """Runs the elastic job of the flags `fv` and `command`; returns the exit status."""
    worker_range = fv.num_workers if isinstance(fv.num_workers, WorkerRange) else None
    if worker_range is None:
        count = fv.num_workers or 1
        worker_range = WorkerRange(count, count)
    if fv.chief or fv.num_ps or fv.evaluator or fv.slurm:
        raise LaunchError(
            f"Invalid flags: an elastic job (`--num_workers {worker_range}`) runs workers only. "
            "Expected no --chief, --num_ps, --evaluator or --slurm."
        )
    check_global_batch(command, worker_range, fv.elastic_batch)
    job = ElasticJob(
        command,
        worker_range=worker_range,
        batch_mode=fv.elastic_batch,
        keras_compat=fv.keras_compat,
        port=fv.port,
        remote_cmd=fv.remote_cmd,
    )
    say = say or supervisor._say_stderr
    discovery = _discovery.Discovery(
        fv.host_discovery, _world_from_flags(fv, worker_range), say, timeout=fv.discovery_timeout
    )
    result = ElasticSupervisor(
        job,
        discovery,
        worker_range=worker_range,
        elastic_timeout=fv.elastic_timeout,
        discovery_interval=fv.discovery_interval,
        host_cooldown=fv.host_cooldown,
        resize_cooldown=fv.resize_cooldown,
        max_restarts=fv.max_restarts,
        restart_backoff=fv.restart_backoff,
        grace_period=fv.grace_period,
        task_timeout=fv.task_timeout or None,
        finish_timeout=fv.finish_timeout or None,
        heartbeat_timeout=fv.heartbeat_timeout or None,
        log_dir=fv.log_dir,
        say=say,
    ).run()
    return result.exit_code
