"""Keras + TensorFlow gap: every `fit` under a strategy drops a live distributed iterator at once.

Under a `tf.distribute` strategy, Keras's `fit` (TensorFlow backend,
`TensorFlowTrainer._maybe_symbolic_build`) takes one batch from the epoch iterator to
build the model, then `epoch_iterator.reset()` drops that iterator right away. Its
`MultiDeviceIterator` is then torn down while its background thread is still filling its
buffer from the host pipeline, and now and then that thread runs freed memory: a SIGSEGV
in `DatasetBaseIterator::GetNext` (thread `MultiDeviceBuffer::BackgroundThread`) while the
main thread waits in `MultiDeviceBuffer::Reset` from `~MultiDeviceIterator`, reached from
`~IteratorResource` of the per-device iterator (gdb, TF 2.21.0, Keras 3.15.1). Python shows
it as `Fatal Python error: Segmentation fault` at `epoch_iterator.py`, `reset`.
Measured with `tests/_iterator_teardown_repro.py` (fits under `one_device` that stop in
`on_train_begin`; two copies side by side, or beside a pytest run, on 2 cores): unpatched,
5 of 5 runs died with SIGSEGV at that place within 250 to 850 fits (one alone on a quiet
machine ran 2,000 fits without a crash: it needs a busy machine); kept until the model's
next fit (this module's first form, ~60 ms later), 0 of 2 x 2,000 fits side by side; parked
as below, 0 of 2 x 2,000 (beside a full pytest run). In this suite it killed an xdist
worker in 2 of the last 3 full runs (tests/test_hostile_backup.py, 53 such fits in a test).

`keep_first_input_iterator()` makes no such iterator: for array and `tf.data` inputs it
builds the model from the distributed dataset's `element_spec` (one replica's specs: shapes
and dtypes are all `_symbolic_build` reads; the batch dimension is None, as a functional
model's `Input` has it), so nothing is torn down live. Its first form parked that iterator
in a module list and freed it at a later `fit`; those teardowns wait for TensorFlow's
background threads, and they stalled later fits: a fast-tier run spent 182 s of its ~700
worker-seconds in them, one fit 119 s (`_release_parked` timed per call). A Python
generator or `PyDataset` input is left as Keras has it (its iterator pulls from the user's
own source, and the specs of its first batch are not known before it is read).
A `fit` that raises mid-epoch (a callback, an interrupt, a bad batch) leaves its live
iterator in Keras's own cycle (`EpochIterator._epoch_iterator`, a generator whose frame
holds the epoch iterator; tests/test_compat_backup.py), and only a garbage collection
tears it down, live, with the same race, and slowly: in this suite such collections
stalled for up to 77 s (tests/_gc_probe.py). `park_interrupted_inputs()` wraps
`TensorFlowTrainer.fit`: when it raises, each epoch iterator that fit made (training and
validation) has its current iterator parked (kept in a module list; the start of a later
strategy `fit` hands those parked at least a second before to a thread that frees them,
one fit's worth at a time: a teardown waits, idle, for TensorFlow's background threads,
seconds on a busy machine, and the fit goes on meanwhile) and its generator dropped, which
breaks the cycle, so reference counting frees the rest once the caller drops the
exception. Measured on tests/test_backup_and_restore.py + tests/test_hostile_backup.py
(fast tier, one process): time in garbage collection 62 s -> 0.3 s, wall 139 s -> 51 s.

Gate: `TensorFlowTrainer._maybe_symbolic_build`, `TensorFlowTrainer.fit`,
`TFEpochIterator.__init__`, and `EpochIterator._current_iterator` / `._epoch_iterator`
exist (checked on Keras 3.15.1 only).
FIXED_IN: none as of TF 2.21 / Keras 3.15.
"""

import atexit
import functools
import logging
import threading
import time
import weakref

__all__ = [
    "CHECKED_ON",
    "FIXED_IN",
    "keep_first_input_iterator",
    "park_interrupted_inputs",
    "parked_iterators",
    "wait_until_freed",
]

CHECKED_ON = ("3.15", "3.15")
FIXED_IN = None
_PARKED = []  # (when, iterator): live iterators of a raising fit, freed at a later strategy `fit`
_IDLE_AFTER = 1.0  # seconds parked before an iterator is freed: its buffers are full by then
_lock = threading.Lock()
_freeing = {"thread": None}  # the thread freeing the last idle parked iterators (`_release_parked`)
_FREE_WAIT_S = 120.0  # the most a fit waits for the previous teardown before it goes on
_EXIT_WAIT_S = 30.0  # the most the interpreter's exit waits for a teardown in flight
_fits = threading.local()  # .made: per running fit (innermost last), weak refs to its epoch iterators


def keep_first_input_iterator():
    """A strategy `fit` builds its model from the dataset's specs, no iterator; False where unsupported."""
    try:
        from keras.src.backend.tensorflow import trainer
    except ImportError:
        return False
    trainer_class = getattr(trainer, "TensorFlowTrainer", None)
    original = getattr(trainer_class, "_maybe_symbolic_build", None)
    if not callable(original):
        return False
    with _lock:
        if not getattr(trainer_class._maybe_symbolic_build, "_tfscale_kept", False):
            trainer_class._maybe_symbolic_build = _kept(original)
    return True


def park_interrupted_inputs():
    """A raising `fit` parks its live input iterators, breaking Keras's cycle; False if unsupported."""
    try:
        from keras.src.backend.tensorflow import trainer
    except ImportError:
        return False
    trainer_class = getattr(trainer, "TensorFlowTrainer", None)
    epoch_class = getattr(trainer, "TFEpochIterator", None)
    fit, init = getattr(trainer_class, "fit", None), getattr(epoch_class, "__init__", None)
    if not (callable(fit) and callable(init)):
        return False
    with _lock:
        if not getattr(epoch_class.__init__, "_tfscale_registers", False):
            epoch_class.__init__ = _registering(epoch_class.__init__)
        if not getattr(trainer_class.fit, "_tfscale_parks", False):
            trainer_class.fit = _parking(trainer_class.fit)
    return True


def parked_iterators():
    """The iterators parked now (tests)."""
    with _lock:
        return [iterator for _, iterator in _PARKED]


def _release_parked():
    """Frees the iterators parked at least _IDLE_AFTER seconds ago. Called at the start of a fit.

    A teardown waits for TensorFlow's background threads, and on a busy machine that wait is
    long and idle: fits under a 2-replica MirroredStrategy, each after a raising fit, beside
    two busy loops on 2 cores, spent 1.1-3.8 s per teardown with 0.0-0.1 s of CPU
    (tests/_parked_free_repro.py; alone on a quiet machine, 6 ms at most). So the
    teardowns run in a thread (`_free`) while the fit goes on, one fit's worth at a time:
    this call first waits for the previous teardown (`wait_until_freed`). That bound keeps
    them from piling up: a reaper with a queue (stop 39) fell behind in a full test run, 60
    iterators queued, the worker grew to 1,638 threads (tf.data's, gdb), and each teardown
    then took over 30 s. Measured with the busy loops, 25 such fits (`_parked_free_repro.py
    25 [--inline]`, two runs each): 16.1 / 16.4 s in this call when it tore down in place,
    0.18 / 2.6 s now (one call waited 2.4 s for the previous teardown); whole run 57 / 55 s
    -> 43 / 42 s.
    """
    now = time.monotonic()
    with _lock:
        idle = [entry for entry in _PARKED if now - entry[0] >= _IDLE_AFTER]
        _PARKED[:] = [entry for entry in _PARKED if now - entry[0] < _IDLE_AFTER]
    if not idle:
        return
    wait_until_freed()
    # A daemon, so that nothing (SIGTERM's exit included) waits on it unbounded; the
    # interpreter's exit waits for it up to _EXIT_WAIT_S (`_join_at_exit`) before finalizing
    # TensorFlow under it. Its list is the iterators' last reference.
    thread = threading.Thread(target=_free, args=(idle,), name="tfscale-free-parked-iterators", daemon=True)
    del idle
    _freeing["thread"] = thread
    thread.start()


def _free(entries):
    entries.clear()  # the last references: the teardowns run here, in this thread


@atexit.register
def _join_at_exit():
    wait_until_freed(timeout_s=_EXIT_WAIT_S)


def wait_until_freed(timeout_s=None):
    """Waits for the parked iterators being freed (at most `timeout_s`, default 120 s: then
    logs a warning and goes on). Returns whether none is being freed now."""
    thread = _freeing["thread"]
    if thread is None:
        return True
    thread.join(_FREE_WAIT_S if timeout_s is None else timeout_s)
    if thread.is_alive():
        logging.getLogger("tfscale").warning(
            "Freeing the input iterators of an interrupted fit has taken over %.0f s (TensorFlow's "
            "background threads); going on without waiting for it.",
            _FREE_WAIT_S if timeout_s is None else timeout_s,
        )
        return False
    return True


def _batch_spec(epoch_iterator):
    """One replica's batch as `tf.TypeSpec`s (shape and dtype: all `_symbolic_build` reads),
    from the distributed dataset's `element_spec`, or None where it has none."""
    import tensorflow as tf

    spec = getattr(getattr(epoch_iterator, "_distributed_dataset", None), "element_spec", None)
    if spec is None:
        return None

    def one_replica(leaf):
        per_replica = getattr(leaf, "_value_specs", None)  # values.PerReplicaSpec
        return per_replica[0] if per_replica else leaf

    batch = tf.nest.map_structure(one_replica, spec)
    leaves = tf.nest.flatten(batch)
    return batch if all(hasattr(v, "shape") and hasattr(v, "dtype") for v in leaves) else None


def _kept(original):
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        _release_parked()
        if iterator is not None and data_batch is None and _replayable(iterator):
            batch = _batch_spec(iterator)
            if batch is not None:  # No iterator made, so none to tear down.
                return original(self, iterator=None, data_batch=batch)
        return original(self, iterator=iterator, data_batch=data_batch)

    _maybe_symbolic_build._tfscale_kept = True
    _maybe_symbolic_build.__wrapped__ = original
    return _maybe_symbolic_build


def _registering(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        running = getattr(_fits, "made", None)
        if running:
            running[-1].append(weakref.ref(self))

    __init__._tfscale_registers = True
    return __init__


def _parking(original):
    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        _release_parked()
        running = _fits.__dict__.setdefault("made", [])
        made = []
        running.append(made)
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            _park_inputs(made)
            raise
        finally:
            running.remove(made)

    fit._tfscale_parks = True
    return fit


def _park_inputs(refs):
    """Parks the live iterators of the epoch iterators a raising `fit` made; drops their generators."""
    for ref in refs:
        epoch_iterator = ref()
        if epoch_iterator is None or not _replayable(epoch_iterator):
            continue
        current = getattr(epoch_iterator, "_current_iterator", None)
        if current is not None:
            with _lock:
                _PARKED.append((time.monotonic(), current))
            epoch_iterator._current_iterator = None
        epoch_iterator._epoch_iterator = None  # the generator whose frame holds epoch_iterator


def _replayable(epoch_iterator):
    name = type(getattr(epoch_iterator, "data_adapter", None)).__name__
    return name in ("ArrayDataAdapter", "TFDatasetAdapter")
