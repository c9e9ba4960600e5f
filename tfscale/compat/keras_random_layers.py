"""Keras 3 Dropout under `MirroredStrategy` / `MultiWorkerMirroredStrategy`: one device's masks.

Checked on Keras 3.15.1 with TensorFlow 2.21.0 only.
On one device, `Dropout.call` draws one mask of the whole batch's shape
(`backend.random.dropout(inputs, rate, noise_shape, seed=self.seed_generator)`,
keras/src/layers/regularization/dropout.py), and the seed generator's state moves on by one.
Under a strategy each replica runs the layer on its slice of the global batch: every
replica's copy of the generator's state is the same as one device's, so every replica
draws the mask of a *slice's* shape from one device's seed, that is, the first rows of one
device's mask. Replica r's rows should get rows [offset_r, offset_r + b_r) of it. So a
data-parallel run of a model with Dropout trains on other masks than one device's: other
losses, other weights (measured on tests/test_equivalence.py's dropout models, mirrored on
2 CPUs, 2 epochs: weights up to 0.08 off; its 4 such cases were strict xfails). The same
holds for SpatialDropout1D/2D/3D, GaussianDropout, GaussianNoise, AlphaDropout and the
dropout / recurrent_dropout masks of the RNN cells (`DropoutRNNCell`: LSTM, GRU,
SimpleRNN, ConvLSTM).

The fix, applied where Keras has this unfixed (`needed()`), wraps those layers' `call`
(and `DropoutRNNCell._create_dropout_mask`) and changes them only in training, in the
replica context of a traced Mirrored / MultiWorkerMirrored step with 2+ replicas
(elsewhere Keras's own code runs): the replica's rows are placed at their offset in a batch
of zeros of the global batch's size, Keras's own call runs on it (drawing one device's
numbers, bit for bit), and the replica keeps its rows of the output. The offsets come
from every replica's row count, summed over the replicas as a one-hot vector in one small
all-reduce per call (`keras_optimizer.all_reduce_exact`: an uneven last batch, or an empty
slice, is placed where one device has it), taken in the order in which the replicas'
pieces sit in the global batch (`_piece_order`: under MultiWorkerMirroredStrategy, replica
w * L + l holds piece l * W + w, as `experimental_distribute_dataset` shards them; a
dataset sharded by file has no one-device order, and its replicas still draw distinct rows).
Stock Keras also gives every replica the *same* mask for its row i (same seed, same shape):
the fix removes that correlation too. The same placement serves the pipeline's and
model split's `data_parallel` copies (`run_on_rows`, used by `strategies/_replicas.py`).

Cost: each such layer does N x its elementwise work on N replicas (the mask of the whole
batch), and one all-reduce of N numbers per layer call per training step. A strategy
marked by `keep_replica_random(strategy)` (what `tfscale.strategies.get("mirrored" |
"multi_worker", replica_random=True)` does) keeps Keras's per-replica draws: cheaper,
statistically the same, not one device's numbers.

Every other layer that draws from SeedGenerators of its own (Keras's augmentation layers:
RandomFlip, RandomTranslation, RandomRotation, ...; a user's layer calling `keras.random.*`
with `seed=self.some_generator`) is run the same way: `Layer.__call__` is wrapped to give
such a layer, the first time it is called in a traced replica context, a `call` of its
own that places its rows in the whole batch (`draws_from_own_generators`). This holds
exactly for a layer whose output row i depends on its input row i and the numbers drawn
(what makes it splittable by rows at all). MixUp and CutMix mix the rows of a batch: each
replica would mix its own slice, so in training they raise (`mixes_rows`); they belong in
the input pipeline. A random layer whose input is not one tensor (a dict of images and
boxes) raises too.

Not covered: `keras.random` calls with an integer seed or none (no generator to find:
stateless, the same numbers at every step), `run_eagerly=True`, TPUStrategy (same Keras
code, not exercisable here), and a `noise_shape` whose batch entry is a fixed number other
than 1.

Gate: this fix's own `_FIXED_IN` (None: upstream draws per replica by design), and the
wrapped methods present with the signatures above; otherwise nothing is changed.
Test: tests/test_compat_keras_random_layers.py, and tests/test_equivalence.py's dropout
cases under `mirrored` and `zero1`.
"""

import functools
import inspect

import keras
import tensorflow as tf

from tfscale.compat import keras_optimizer
from tfscale.compat.keras_multi_worker import _version_tuple
from tfscale.errors import Error

__all__ = [
    "CHECKED_ON",
    "NAME_SCOPE",
    "apply",
    "draws_from_own_generators",
    "is_applied",
    "is_dropout_cell",
    "keep_replica_random",
    "mixes_rows",
    "needed",
    "one_line",
    "refuse_row_mixing",
    "run_on_rows",
    "seed_generators",
]

CHECKED_ON = ("3.15.1", "2.21.0")
# The name scope of this fix's all-reduce ops (told apart from the gradients' launches by
# `strategies._communication.traced_all_reduces`).
NAME_SCOPE = "tfscale_random_layers"
# First Keras release whose random layers draw one device's numbers under a strategy; None:
# not planned upstream (each replica draws for its own slice by design).
_FIXED_IN = None
_KEEP = "_tfscale_replica_random"  # on a strategy: keep Keras's per-replica draws
_WRAPPED = "_tfscale_one_device_draws"
_state = {"applied": False, "originals": []}


def needed(version=None):
    """True when this Keras version draws each replica's random numbers for its slice alone."""
    version = _version_tuple(version or keras.__version__)
    if version < (3,):
        return False
    return _FIXED_IN is None or version < _version_tuple(_FIXED_IN)


def is_applied():
    """True once `apply()` has patched this process's random layers."""
    return _state["applied"]


def keep_replica_random(strategy, keep=True):
    """Marks `strategy` to keep (or not) Keras's per-replica random draws."""
    setattr(strategy, _KEEP, bool(keep))


def is_dropout_cell(layer):
    """Whether `layer` is an RNN cell that draws `dropout` / `recurrent_dropout` masks
    through `_create_dropout_mask(step_input, dropout_rate)` (Keras's `DropoutRNNCell`)."""
    return _gate() and isinstance(layer, _layer_classes()[1])


def seed_generators(layer):
    """The SeedGenerators `layer` owns (not its sublayers'): the states its own draws move."""
    return list(getattr(layer, "_seed_generators", None) or ())


def draws_from_own_generators(layer):
    """Whether `layer` draws random numbers from SeedGenerators of its own and is none of the
    layers this module patches by class (Dropout and its kin; an RNN cell's masks): an
    augmentation layer (RandomFlip, ...), a user's layer calling `keras.random.*`."""
    if not seed_generators(layer) or isinstance(layer, _layer_classes()[0]) or is_dropout_cell(layer):
        return False
    return not getattr(type(layer).call, _WRAPPED, False)


def mixes_rows(layer):
    """Whether `layer`'s training output mixes the rows of its batch (MixUp, CutMix)."""
    names = ("MixUp", "CutMix")
    return isinstance(layer, tuple(getattr(keras.layers, n) for n in names if hasattr(keras.layers, n)))


def one_line(error):
    """`error`, marked so that Keras raises it through the layers' calls unchanged (it would
    prepend "Exception encountered when calling ..." and append their arguments)."""
    error._keras_call_info_injected = True  # keras/src/utils/traceback_utils.py
    return error


def refuse_row_mixing(layer, split):
    """Raises `Error` naming `layer` if it mixes rows (`mixes_rows`): `split` says how the
    batch is cut (e.g. "2 replicas")."""
    if mixes_rows(layer):
        raise one_line(
            Error(
                f"Layer {layer.name!r} ({type(layer).__name__}) mixes the rows of a batch: cut into {split}, "
                "each piece would mix its own rows, not one device's batch. Apply it in the input pipeline "
                "(dataset.map) instead."
            )
        )


def run_on_rows(function, inputs, offset, total):
    """`function(whole)[offset : offset + rows]`, where `whole` is `inputs` (`rows` rows)
    placed at row `offset` of `total` rows of zeros: what one device's call gives those rows
    when its numbers are drawn for the whole batch's shape, row by row.

    `function` returns a tensor or a list of tensors (each with the rows of `whole`).
    """
    rows = tf.shape(inputs)[0]
    rest = tf.shape(inputs)[1:]
    offset = tf.cast(offset, rows.dtype)
    total = tf.cast(total, rows.dtype)
    before = tf.zeros(tf.concat([[offset], rest], 0), inputs.dtype)
    after = tf.zeros(tf.concat([[total - offset - rows], rest], 0), inputs.dtype)
    outputs = function(tf.concat([before, inputs, after], 0))

    def mine(output):
        kept = output[offset : offset + rows]
        kept.set_shape(inputs.shape[:1].concatenate(output.shape[1:]))  # a crop changes the rest
        return kept

    return [mine(o) for o in outputs] if isinstance(outputs, (list, tuple)) else mine(outputs)


def _layer_classes():
    from keras.src.layers.regularization import spatial_dropout
    from keras.src.layers.rnn import dropout_rnn_cell

    layers = keras.layers
    # Each class that defines its own `call` (SpatialDropout1D/2D/3D: their base's).
    classes = (
        layers.Dropout,
        spatial_dropout.BaseSpatialDropout,
        layers.GaussianDropout,
        layers.GaussianNoise,
        layers.AlphaDropout,
    )
    return classes, dropout_rnn_cell.DropoutRNNCell


def _gate():
    layer_classes, cell = _layer_classes()
    calls = all(
        "call" in vars(c) and list(inspect.signature(c.call).parameters)[:3] == ["self", "inputs", "training"]
        for c in layer_classes
    )
    mask = getattr(cell, "_create_dropout_mask", None)
    return (
        calls
        and callable(mask)
        and list(inspect.signature(mask).parameters) == ["self", "step_input", "dropout_rate"]
        and "__call__" in vars(keras.layers.Layer)
        and _finds_own_generators()
    )


@functools.cache
def _finds_own_generators():
    """Whether Keras still lists a layer's own SeedGenerators where `seed_generators` reads:
    the list its attribute tracker fills. Made on a bare Layer: a layer with a SeedGenerator
    would create a variable, which starts TensorFlow's context, and a MultiWorkerMirrored
    strategy built after that fails ("Collective ops must be configured at program startup")."""
    layer = keras.layers.Layer()
    tracked = getattr(getattr(layer, "_tracker", None), "config", {}).get("seed_generators")
    own = getattr(layer, "_seed_generators", None)
    return isinstance(tracked, tuple) and len(tracked) == 2 and tracked[1] is own


def _active():
    """In the replica context of a traced Mirrored/MWMS step with 2+ replicas, not kept per replica."""
    if not keras_optimizer._active():
        return False
    strategy = tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync > 1 and not getattr(strategy, _KEEP, False)


def _piece_order(strategy):
    """Which piece of the global batch each replica holds: [(replica, piece)], by replica.

    `experimental_distribute_dataset` (what Keras's `fit` uses) cuts each global batch into
    W x L consecutive pieces (W workers, L replicas each) and shards the pieces over the
    workers: worker w reads pieces w, w + W, ... and gives them to its replicas in turn.
    So replica w * L + l (its id in sync) holds piece l * W + w; one worker: piece = replica.
    """
    count = strategy.num_replicas_in_sync
    workers = getattr(strategy.extended, "_num_workers", 1) or 1  # MWMS: the workers
    local = count // workers
    return [(replica, (replica % local) * workers + replica // local) for replica in range(count)]


def _offset_and_total(inputs):
    """This replica's first row in the global batch, and the global batch's rows."""
    context = tf.distribute.get_replica_context()
    order = _piece_order(tf.distribute.get_strategy())
    replica = context.replica_id_in_sync_group
    rows = tf.cast(tf.shape(inputs)[0], tf.float32)  # exact: below 2^24 rows
    with tf.name_scope(NAME_SCOPE):
        (sizes,) = keras_optimizer.all_reduce_exact([tf.one_hot(replica, len(order)) * rows])
    # The row counts in the order of the pieces, and this replica's piece.
    by_piece = tf.gather(tf.cast(sizes, tf.int32), [r for r, _ in sorted(order, key=lambda o: o[1])])
    piece = tf.gather([p for _, p in order], replica)
    return tf.reduce_sum(by_piece[:piece]), tf.reduce_sum(by_piece)


def _one_device_draws(function, inputs, *args, **kwargs):
    offset, total = _offset_and_total(inputs)
    return run_on_rows(lambda whole: function(whole, *args, **kwargs), inputs, offset, total)


def _make_call(original):
    @functools.wraps(original)
    def call(self, inputs, training=False, *args, **kwargs):
        if not training or not _active():
            return original(self, inputs, training, *args, **kwargs)
        return _one_device_draws(lambda whole: original(self, whole, training, *args, **kwargs), inputs)

    setattr(call, _WRAPPED, True)
    return call


def _is_training(kwargs, default):
    """The `training` a wrapped `call` was given (Keras passes it by keyword; a positional
    argument of a user's layer may be anything else): a Python bool or a tensor counts as
    training unless it is False; None or absent: `default`."""
    training = kwargs.get("training")
    if training is None:
        return default
    return not (isinstance(training, bool) and not training)


def _in_training(kwargs):
    """Whether a layer called with `kwargs` runs in training: its `training` argument, else
    the enclosing call's (Keras's call context), else True."""
    training = kwargs.get("training")
    if training is None:
        from keras.src.backend.common import global_state

        context = global_state.get_global_attribute("current_call_ctx")
        training = getattr(context, "training", None)
    return training is None or not (isinstance(training, bool) and not training)


def _wrap_own_draws(layer):
    """Gives `layer` (`draws_from_own_generators`) a `call` that draws one device's numbers
    for its rows in a traced replica context; its class's `call` elsewhere."""
    original = layer.call

    def call(inputs, *args, **kwargs):
        # A layer without a `training` argument draws whenever it is called.
        if not _is_training(kwargs, default=True) or not _active():
            return original(inputs, *args, **kwargs)
        if not tf.is_tensor(inputs):
            raise one_line(
                Error(
                    f"Layer {layer.name!r} ({type(layer).__name__}) draws random numbers from an input "
                    f"that is not one tensor ({type(inputs).__name__}): tfscale cannot give each replica "
                    "its rows of one device's draws. Pass one tensor, or replica_random=True to keep "
                    "per-replica draws."
                )
            )
        return _one_device_draws(lambda whole: original(whole, *args, **kwargs), inputs)

    setattr(call, _WRAPPED, True)
    # Layers track the attributes they are given; a bound method is not state, so bypass that.
    object.__setattr__(layer, "call", call)


def _make_layer_call(original):
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        if seed_generators(self) and not getattr(self.call, _WRAPPED, False) and _active():
            # Here, not in `call`: Keras would add lines to an error raised in `call`.
            if mixes_rows(self) and _in_training(kwargs):
                refuse_row_mixing(self, f"{tf.distribute.get_strategy().num_replicas_in_sync} replicas")
            if draws_from_own_generators(self):
                _wrap_own_draws(self)
        return original(self, *args, **kwargs)

    setattr(__call__, _WRAPPED, True)
    return __call__


def _make_mask(original):
    @functools.wraps(original)
    def _create_dropout_mask(self, step_input, dropout_rate):
        if not _active():
            return original(self, step_input, dropout_rate)
        return _one_device_draws(lambda whole: original(self, whole, dropout_rate), step_input)

    setattr(_create_dropout_mask, _WRAPPED, True)
    return _create_dropout_mask


def apply():
    """Makes Dropout-like layers under data parallelism draw one device's numbers.

    Idempotent. Does nothing where upstream changed this or the patched methods are gone.

    Returns:
        True if the fix is in effect after the call, False if not.
    """
    if _state["applied"]:
        return True
    if not needed() or not _gate():
        return False
    layer_classes, cell = _layer_classes()
    for layer_class in layer_classes:
        _state["originals"].append((layer_class, "call", layer_class.__dict__["call"]))
        layer_class.call = _make_call(layer_class.call)
    _state["originals"].append((cell, "_create_dropout_mask", cell._create_dropout_mask))
    cell._create_dropout_mask = _make_mask(cell._create_dropout_mask)
    base = keras.layers.Layer
    _state["originals"].append((base, "__call__", base.__dict__["__call__"]))
    base.__call__ = _make_layer_call(base.__call__)
    _state["applied"] = True
    return True


def _unapply():
    """Restores stock Keras (tests compare against it)."""
    for owner, name, original in reversed(_state["originals"]):
        setattr(owner, name, original)
    _state["originals"].clear()
    _state["applied"] = False
