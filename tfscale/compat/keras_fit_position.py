"""Keras 3 gap: no mid-epoch resume. The private internals exact resume needs, gated.

Keras 3 (3.0 to at least 3.15.1, TensorFlow backend) resumes a backup only at an epoch
boundary: its `BackupAndRestore.on_train_begin` sets `model._initial_epoch` and nothing
else, so a mid-epoch backup re-runs the whole epoch (tf_keras had `_initial_step` in its
DataHandler for this; Keras 3 has no public equivalent and no upstream issue tracks it
as of 3.15.1). `fit` gives callbacks no handle on its input, so this module:

1. finds the `TFEpochIterator` of the running `fit` call (the local `epoch_iterator`
   of the `fit` frame whose `self` is the model; it exists before `on_train_begin`);
2. counts the input iterators that `fit` creates (`_get_iterator`), and reads how many
   batches the current one has given (`_steps_seen`), which is the input position;
3. on resume, replays that position once: creates and drops as many fresh iterators as
   the interrupted run had made (a dataset that reshuffles on each iteration then
   gives the same order), discards the consumed batches of the current one, and lets
   the loop start at the saved step. Discarded batches are read, never trained on, and
   callbacks see only the steps that run, numbered as in an uninterrupted run.

Supported: the TensorFlow backend's `TFEpochIterator`, where `fit` calls
`train_function(iterator)` and the function itself pulls the batches.

Checked on Keras 3.0 to 3.15.1 with TensorFlow 2.16 to 2.21. Private names used:
`Model._initial_epoch` (also what Keras's own `BackupAndRestore` sets), and
`EpochIterator._get_iterator`, `._enumerate_iterator`, `._steps_seen`,
`._current_iterator`, and (`release_input_after_fit`) `._epoch_iterator` and `fit`'s local
`callbacks`. Gate: `supported(epoch_iterator)` -- Keras 3 and every one of
these present; otherwise no tracker is made, and a mid-epoch backup is refused with
one line instead of resumed wrongly (epoch-boundary backups still work).
tests/test_compat_backup.py fails when any of them changes meaning.
"""

import inspect
import weakref

import keras

__all__ = [
    "CHECKED_ON",
    "InputTracker",
    "find_epoch_iterator",
    "fit_on_stack",
    "release_input_after_fit",
    "set_initial_epoch",
    "supported",
]

CHECKED_ON = ("3.0.0", "3.15.1")
_ITERATOR_ATTRIBUTES = ("_get_iterator", "_enumerate_iterator", "_steps_seen", "_current_iterator")


def supported(epoch_iterator, keras_version=keras.__version__):
    """The gate: Keras 3 and an epoch iterator that has every private name used here."""
    return keras_version.split(".")[0] == "3" and all(
        hasattr(epoch_iterator, name)
        for name in (*_ITERATOR_ATTRIBUTES, "steps_per_execution", "steps_per_epoch")
    )


def _fit_frames(model, frame):
    while frame is not None:
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            yield frame
        frame = frame.f_back


def fit_on_stack(model, frame=None):
    """Whether a `fit` call of `model` is running on the stack of `frame` (default: here)."""
    return next(_fit_frames(model, frame or inspect.currentframe()), None) is not None


def set_initial_epoch(model, epoch):
    """What Keras's own callback does: `fit` starts at `model._initial_epoch` when set."""
    model._initial_epoch = epoch


def find_epoch_iterator(model):
    """The `epoch_iterator` of the `fit` call of `model` on the stack (if `supported`), or None."""
    for frame in _fit_frames(model, inspect.currentframe()):
        found = frame.f_locals.get("epoch_iterator")
        if found is not None and supported(found):
            return found
    return None


class InputTracker:
    """Tracks and replays the input position of one `fit` call's epoch iterator.

    Holds the epoch iterator only weakly, and the methods it shadows on it reach back to
    the tracker and the iterator only weakly too: a tracker makes no reference cycle, so
    a `fit` that raises frees its input (a tf.data iterator) by reference counting.

    Args:
        epoch_iterator: the `TFEpochIterator` found by `find_epoch_iterator`.
        iterators_made: iterators made before this `fit` call (from a backup).
    """

    def __init__(self, epoch_iterator, iterators_made=0):
        self._ref = weakref.ref(epoch_iterator)
        self.iterators_made = iterators_made
        tracker, ref, get_iterator = weakref.ref(self), self._ref, type(epoch_iterator)._get_iterator

        def _counted_get_iterator():
            if tracker() is not None:
                tracker().iterators_made += 1
            return get_iterator(ref())

        # Instance attributes shadow the methods for this one iterator object only.
        epoch_iterator._get_iterator = _counted_get_iterator

    @property
    def _it(self):
        return self._ref()

    @property
    def steps_per_execution(self):
        return self._it.steps_per_execution

    def element_spec(self):
        """The spec of one batch of the current input iterator, or None if there is none."""
        it = self._it
        return getattr(getattr(it, "_current_iterator", None), "element_spec", None)

    def position(self, *, at_epoch_end):
        """`(iterators_made, live, batches_taken)` to store in a backup.

        `live` says whether the next step continues the current iterator (mid-epoch,
        or a `steps_per_epoch` run that keeps one iterator across epochs).
        """
        if not at_epoch_end:
            return self.iterators_made, True, int(self._it._steps_seen)
        live = self._it.steps_per_epoch is not None and self._it._current_iterator is not None
        return self.iterators_made, live, int(self._it._steps_seen) if live else 0

    def resume(self, *, step, iterators_made, live, batches_taken):
        """Makes the next epoch of `fit` start at `step` with the input where it was.

        The saved position is replayed now (before `fit` reads its initial epoch), so a
        backup taken at the last step of an epoch is seen to leave nothing of it: then
        the input stands where the next epoch starts and this returns True (the caller
        starts `fit` at the next epoch). Running that epoch with no step would end it
        with metrics that were never updated (Keras raises "Cannot get result() since
        the metric has not yet been built").
        """
        it = self._it
        drop = max(0, iterators_made - 1 if live else iterators_made)
        for _ in range(drop):
            iter(type(it)._get_iterator(it))
        self.iterators_made += drop
        if not (step or (live and batches_taken)):
            return False
        taken = batches_taken if live else 0
        spe = it.steps_per_execution
        generator = type(it)._enumerate_iterator(it)
        try:
            item = next(generator)
            for _ in range(taken):
                next(item[2])
            for _ in range(step // spe):
                item = next(generator)
        except (StopIteration, RuntimeError):
            # The epoch is over (or the input is shorter than when the backup was made).
            if it._current_iterator is not None and it.steps_per_epoch is not None:
                it._steps_seen = taken  # one iterator across epochs: `taken` read from it
            return True
        # The loop above counted `spe` batches per step it skipped; the truth is `taken`.
        ref = self._ref

        def resumed_epoch():
            target = ref()
            if target is not None:  # one epoch only; later epochs are Keras's own
                target.__dict__.pop("_enumerate_iterator", None)
                target._steps_seen = taken + spe
            del target
            yield item
            yield from generator

        it._enumerate_iterator = resumed_epoch
        return False

    def close(self):
        it = self._it
        if it is not None:
            it.__dict__.pop("_get_iterator", None)
            it.__dict__.pop("_enumerate_iterator", None)


def release_input_after_fit(model, epoch_iterator):
    """Breaks Keras's own cycle through `epoch_iterator` once the running `fit` has gone.

    Keras 3 (checked 3.15.1) keeps the epoch's generator in `EpochIterator._epoch_iterator`
    and that generator's frame holds the iterator: a cycle that, when `fit` raises
    mid-epoch, keeps the tf.data iterator until a full garbage collection, whose
    destructor then blocks up to a minute (TF 2.21). `fit`'s `CallbackList` (its local
    `callbacks`) is freed when `fit` has returned or its exception has been dropped; at
    that moment this drops the generator, and reference counting frees the input.
    Reproducer: tests/test_compat_backup.py (plain Keras keeps it; this frees it).
    Returns False (and does nothing) where `fit`'s frame has no such local.
    """
    frame = next(_fit_frames(model, inspect.currentframe()), None)
    callbacks = frame.f_locals.get("callbacks") if frame is not None else None
    if callbacks is None or not hasattr(epoch_iterator, "_epoch_iterator"):
        return False
    try:
        weakref.finalize(callbacks, _drop_epoch_generator, weakref.ref(epoch_iterator))
    except TypeError:  # a list, or another object without weak references
        return False
    return True


def _drop_epoch_generator(ref):
    epoch_iterator = ref()
    if epoch_iterator is not None:
        epoch_iterator._epoch_iterator = None
