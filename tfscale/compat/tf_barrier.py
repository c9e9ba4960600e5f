"""TensorFlow gap: no public barrier between the workers of a cluster.

`CommunicationProfiler` starts and stops TensorFlow's profiler at a step boundary. Under
`MultiWorkerMirroredStrategy` (TF 2.21, 2 processes on loopback) a worker crashed now and
then ("double free or corruption", SIGSEGV) when its profiler started or stopped while
collective work of the step just returned was still running, in this process (the
executor's completion callbacks) or in the peer's half of the same all-reduce (a worker
that is one step ahead starts the next collective, whose receive lands here). TensorFlow
has no public API that waits for both; it has two private ones:

- `context.async_wait()` (`tensorflow.python.eager.context`): returns once every pending
  op and function of this process's executors has finished;
- `context.context().wait_at_barrier(barrier_id, timeout_in_ms)`: the coordination
  service's barrier (the service `MultiWorkerMirroredStrategy` starts on every worker,
  TF >= 2.9), which returns once every task of the cluster has reached it.

Called in that order on every worker, the profiler then starts or stops when no collective
is in flight anywhere in the cluster: a deterministic order instead of the 0.1 s pause
that preceded this module. No upstream issue tracks the crash itself as of TF 2.21.
Checked on TF 2.16 to 2.21. Gate: `available()`, both present; otherwise `quiesce` only
waits for what it can and returns False. tests/test_compat.py checks the gate; the barrier
itself runs in tests/test_train.py's 2-worker `--profile_steps` job (a missing method
fails it).
"""

__all__ = ["CHECKED_ON", "available", "quiesce"]

CHECKED_ON = ("2.16", "2.21")


def _context():
    from tensorflow.python.eager import context

    return context


def available():
    """The gate: this TensorFlow has `async_wait` and the coordination service barrier."""
    context = _context()
    return callable(getattr(context, "async_wait", None)) and callable(
        getattr(context.context(), "wait_at_barrier", None)
    )


def quiesce(barrier_id, *, multi_worker, timeout_s):
    """Waits for this process's pending ops, then (multi-worker) for every task at `barrier_id`.

    Every task must call it with the same `barrier_id`, once per id. Returns whether the
    full order was kept (False where the gate is closed: nothing is waited for then).

    Raises:
        tf.errors.DeadlineExceededError (or another `tf.errors.OpError`): a task did not
            reach the barrier within `timeout_s`, or the coordination service reported a
            task unhealthy.
    """
    if not available():
        return False
    context = _context()
    context.async_wait()
    if multi_worker:
        context.context().wait_at_barrier(barrier_id, int(timeout_s * 1000))
    return True
