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
machine ran 2,000 fits without a crash: it needs a busy machine); kept (this module), 0 of
2 x 2,000 fits side by side. In this suite it killed an xdist worker in 2 of the last 3 full
runs (tests/test_hostile_backup.py, 53 such fits in one test).

`keep_first_input_iterator()` keeps that iterator referenced (per model, weakly keyed)
until the model's next `fit` under a strategy or until the model is freed, so it is torn
down long after its buffer has filled and its background thread waits. It is never read
again; the batches `fit` trains on come from the iterators Keras makes afterwards, exactly
as before. Cost: one more live iterator per model between fits (its prefetch buffer, a
couple of batches). Kept only for array and `tf.data` inputs, where a longer-lived
iterator cannot change what later iterators yield; a Python generator or `PyDataset`
input is left as Keras has it (its iterator pulls from the user's own source).
Not covered (not a drop right after creation, a different timing): a `fit` interrupted
mid-epoch, or one that stops early (`steps_per_epoch`, `stop_training`), also drops a live
iterator; no crash of that kind has been seen here.

Gate: `TensorFlowTrainer._maybe_symbolic_build` and `EpochIterator._current_iterator`
exist (checked on Keras 3.15.1 only). FIXED_IN: none as of TF 2.21 / Keras 3.15.
"""

import threading
import weakref

__all__ = ["CHECKED_ON", "FIXED_IN", "keep_first_input_iterator", "kept_iterator"]

CHECKED_ON = ("3.15", "3.15")
FIXED_IN = None
_KEPT = weakref.WeakKeyDictionary()  # model -> the iterator its last symbolic build used
_lock = threading.Lock()


def keep_first_input_iterator():
    """Keeps a strategy `fit`'s symbolic-build iterator to the model's next `fit`; False where unsupported."""
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


def kept_iterator(model):
    """The iterator kept for `model` (tests), or None."""
    return _KEPT.get(model)


def _kept(original):
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        result = original(self, iterator=iterator, data_batch=data_batch)
        current = getattr(iterator, "_current_iterator", None)
        if current is not None and _replayable(iterator):
            try:
                _KEPT[self] = current  # replaces (and frees) the one of this model's last fit
            except TypeError:  # a model that cannot be weakly referenced: as Keras has it
                pass
        return result

    _maybe_symbolic_build._tfscale_kept = True
    _maybe_symbolic_build.__wrapped__ = original
    return _maybe_symbolic_build


def _replayable(epoch_iterator):
    name = type(getattr(epoch_iterator, "data_adapter", None)).__name__
    return name in ("ArrayDataAdapter", "TFDatasetAdapter")
