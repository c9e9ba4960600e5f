"""TensorFlow gap: `PreemptionCheckpointHandler` probes for GCP over HTTP each time it is made.

`tf.distribute.experimental.PreemptionCheckpointHandler.__init__` calls
`failure_handling_util.detect_platform()`, whose `on_gcp()` sends an HTTP GET to
`metadata.google.internal` (5 s timeout) on every construction, so once per `fit` with
`save_before_preemption`. Off GCP the request fails, and the caught `requests` exception
leaves a reference cycle (exception -> traceback -> frames) that holds every frame up
the caller's stack, Keras's `fit` with its tf.data iterator among them, until a full
garbage collection; that iterator's destructor then blocks up to a minute (TF 2.21).
Where DNS answers but the route does not, each `fit` also waits up to 5 s. No upstream
issue filed as of TF 2.21; the same code since TF 2.12. Checked on TF 2.12 to 2.21.

`probe_once()` asks `on_gcp()` once per process, in a short-lived thread (its frames are
the only ones a failed request's cycle can hold), and puts the answer in its place.
Gate: the module has a callable `on_gcp`; otherwise this does nothing and returns False.
tests/test_compat_backup.py (an interrupted, resumed `fit` frees its input without a
garbage collection) fails without it.
"""

import threading

__all__ = ["CHECKED_ON", "probe_once"]

CHECKED_ON = ("2.12", "2.21")
# TensorFlow's own request times out after 5 s; past this the answer is "not GCP".
_PROBE_TIMEOUT_S = 10


def probe_once():
    """Replaces TensorFlow's per-call GCP probe with one answer; False where there is none."""
    try:
        from tensorflow.python.distribute.failure_handling import failure_handling_util as util
    except ImportError:
        return False
    original = getattr(util, "on_gcp", None)
    if not callable(original):
        return False
    if getattr(original, "_tfscale_cached", False):
        return True
    answer = []
    thread = threading.Thread(
        target=lambda: answer.append(bool(original())), name="tfscale-gcp-probe", daemon=True
    )
    thread.start()
    thread.join(_PROBE_TIMEOUT_S)
    on_gcp = _cached(bool(answer and answer[0]))
    util.on_gcp = on_gcp
    return True


def _cached(answer):
    def on_gcp():
        return answer

    on_gcp._tfscale_cached = True
    return on_gcp
