"""Data parallelism over copies of a model-parallel model: one all-reduce per device position.

Shared by the pipeline and model split (`data_parallel=D`): replica r of a model cut into
parts lives on its own group of devices, and part k of every replica sits at the same
*position* k of its group. Each step, every replica computes gradients on its slice of the
batch; the gradients of position k are packed into one flat tensor per replica and summed
across the D replicas by an all-reduce placed on the D devices of that position (each
device receives the other D - 1 packed tensors and adds all D in replica order); then
every replica applies the same
summed gradients with its own optimizer (same class and config), so the copies stay equal
and each replica's optimizer slots live beside its variables. Nothing here knows which
pipeline schedule produced the gradients.

Why not `CollectiveReduceV2` (what MultiWorkerMirroredStrategy uses): between logical CPU
devices of one process it never completed here (TF 2.21; a 2-device, 2-float reduce inside
a `tf.function` still hung after 60 s, with 16 inter-op threads too). The explicit sum
moves (D - 1) x bytes into each device, the same as a ring all-reduce for D = 2, and keeps
the replicas bit-identical.

Replica 0 is the model the user sees: its variables and optimizer are the ones tracked by
Keras (weights files, backups); `sync` copies them into the other replicas after anything
outside training writes them (a restore, `load_weights`, `set_weights`).
"""

import contextlib
import inspect

import keras
import numpy as np
import tensorflow as tf

from tfscale.compat import keras_random_layers, keras_weight_decay
from tfscale.strategies import _gradients
from tfscale.strategies._devices import device_key
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check
from tfscale.strategies._placement import place_slots_with_variables, variable_device

__all__ = ["Replicas", "check_data_parallel", "draw_as_whole_batch", "draws_in_training", "group_devices"]

# Layers whose training output draws random numbers of the input's shape, row by row.
RANDOM_LAYERS = (
    keras.layers.Dropout,  # and SpatialDropout1D/2D/3D
    keras.layers.GaussianDropout,
    keras.layers.GaussianNoise,
    keras.layers.AlphaDropout,
)
_WHOLE_BATCH = "_tfscale_whole_batch"


def check_data_parallel(data_parallel, per_replica, devices_here, *, count_argument):
    """D after checking that D replicas of `per_replica` devices fit in `devices_here`.

    Raises:
        StrategyError: D not a positive int, or D x per_replica more than the devices.
    """
    check("data_parallel", data_parallel)
    if devices_here is not None and data_parallel * per_replica > devices_here:
        raise StrategyError(
            f"Invalid value for argument `data_parallel`. Received: data_parallel={data_parallel} x "
            f"{count_argument}={per_replica} = {data_parallel * per_replica} devices, more than the "
            f"{devices_here} here. Expected data_parallel x {count_argument} <= {devices_here}."
        )
    return data_parallel


def group_devices(devices, data_parallel):
    """Cuts a flat list of D x K devices into D groups of K (replica r: devices[r*K:(r+1)*K])."""
    size = len(devices) // data_parallel
    return [list(devices[r * size : (r + 1) * size]) for r in range(data_parallel)]


def _pack(tensors):
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], axis=0)


def _unpack(flat, shapes):
    """`flat` cut back into tensors of `shapes` (the variables' shapes, always known)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    return [tf.reshape(piece, shape) for piece, shape in zip(tf.split(flat, sizes), shapes)]


class Replicas:
    """D copies of one model's layers, their optimizers, and the gradient sum.

    Args:
        replicas: per replica, the objects (layers, or whole models) that hold its state,
            aligned: the same layer at the same index in every replica. Each one's
            `trainable_variables` and `variables` are read when needed, so a layer frozen
            or unfrozen (then compiled again, as Keras asks) changes what is trained.
    """

    def __init__(self, replicas):
        self.holders = [list(rs) for rs in replicas]
        self.size = len(self.holders)
        self._trees = [layer_tree(holders) for holders in self.holders]
        kinds = [[type(layer) for layer in tree] for tree in self._trees]
        if any(k != kinds[0] for k in kinds) or any(
            len(vs) != len(self.variables[0]) for vs in self.variables
        ):
            raise StrategyError("Replicas of a data-parallel model must have the same layers and variables.")
        self.optimizers = None  # replicas 1..D-1; replica 0 uses the model's own optimizer

    @property
    def variables(self):
        """Per replica, its trainable variables in one fixed order (what is differentiated)."""
        return [[v for holder in holders for v in holder.trainable_variables] for holders in self.holders]

    @property
    def state(self):
        """Per replica, all its variables: weights, statistics and seed-generator states."""
        return [[v for holder in holders for v in holder.variables] for holders in self.holders]

    @property
    def positions(self):
        """Variable i is at device position `positions[i]` in every replica (same part)."""
        return _position_keys(self.variables[0])

    def check_layers(self):
        """Refuses layers whose training differs when each replica sees 1/D of the batch.

        Raises:
            StrategyError: a trainable BatchNormalization (it normalises by batch statistics).
        """
        if self.size == 1:
            return
        for layer in self._trees[0]:
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise StrategyError(
                    f"Layer {layer.name!r} (BatchNormalization) would normalise each copy's 1/{self.size} "
                    f"of the batch by that part's mean and variance under data_parallel={self.size}, not "
                    "by the whole batch's as one device does (outputs, loss and moving statistics would "
                    "differ). Expected data_parallel=1, the layer frozen (trainable=False: it then uses "
                    "its moving statistics, exactly as one device), or LayerNormalization."
                )

    def follow_trainable(self):
        """Gives every replica's layers and variables replica 0's `trainable` flags."""
        for tree in self._trees[1:]:
            for source, target in zip(self._trees[0], tree):
                if target.trainable != source.trainable:
                    target.trainable = source.trainable  # Keras sets the nested layers too
        for variables in self.state[1:]:
            for source, target in zip(self.state[0], variables):
                target.trainable = source.trainable

    def make_optimizers(self, optimizer):
        """Gives replicas 1..D-1 an optimizer like `optimizer` (slots beside their variables).

        Each copy reads `optimizer`'s learning-rate variable, so a callback that sets
        `model.optimizer.learning_rate` sets it for every replica; its weight-decay
        exclusions name the copy's own variables.
        """
        self.optimizers = [optimizer]
        for variables in self.variables[1:]:
            copy = type(optimizer).from_config(optimizer.get_config())
            if isinstance(optimizer.learning_rate, keras.Variable):
                copy.learning_rate = _LearningRateOf(optimizer)
            keras_weight_decay.copy_exclusions(optimizer, copy, zip(self.variables[0], variables))
            place_slots_with_variables(copy)
            copy.build(variables)
            self.optimizers.append(copy)
        if optimizer.built and self.size > 1:
            # Built by an earlier fit for other trainable variables (Keras refuses it too).
            mine = [tuple(v.shape) for v in _own_state(optimizer)]
            if mine != [tuple(v.shape) for v in self.optimizers[1].variables]:
                raise StrategyError(
                    f"Optimizer {optimizer.name!r} was built for other trainable variables than the "
                    "model trains now (a layer's `trainable` changed). Expected a new optimizer "
                    "instance in compile() after changing `trainable`, as Keras requires."
                )

    def all_reduce(self, gradients):
        """Sums each variable's gradient over the replicas; returns one summed list per replica.

        Args:
            gradients: per replica, a list of gradient tensors aligned with `variables`.
        """
        if self.size == 1:
            return [list(gradients[0])]
        summed = [list(gs) for gs in gradients]
        for position in dict.fromkeys(self.positions):
            index = [i for i, p in enumerate(self.positions) if p == position]
            devices = [variable_device(vs[index[0]]) for vs in self.variables]
            sparse = [i for i in index if any(isinstance(gs[i], tf.IndexedSlices) for gs in gradients)]
            _gather_sparse(sparse, gradients, devices, summed)
            index = [i for i in index if i not in sparse]
            if not index:
                continue
            shapes = [tuple(self.variables[0][i].shape) for i in index]
            packed = []
            for device, grads in zip(devices, gradients):
                with tf.device(device), tf.name_scope("data_parallel/pack"):
                    packed.append(_pack([grads[i] for i in index]))
            for r, device in enumerate(devices):
                # Every device adds the D packed tensors in replica order: the sums are
                # bit-identical on all replicas, so the copies never drift apart.
                with tf.device(device), tf.name_scope("data_parallel/all_reduce"):
                    total = tf.add_n(packed)
                    for i, g in zip(index, _unpack(total, shapes)):
                        summed[r][i] = g
        return summed

    def apply(self, gradients):
        """Applies each replica's (summed) gradients with its optimizer."""
        for optimizer, grads, variables in zip(self.optimizers, gradients, self.variables):
            optimizer.apply_gradients(zip(grads, variables))

    def sync_seeds(self):
        """Copies replica 0's seed-generator states into the others (after evaluate or
        predict, which run replica 0 only)."""
        sources = _seed_states(self._trees[0])
        for tree in self._trees[1:]:
            for target, source in zip(_seed_states(tree), sources, strict=True):
                target.assign(source.value)

    def sync(self):
        """Copies replica 0's state (all its variables, and its optimizer's once built) into
        the others: weights, statistics, and the seed-generator states Dropout draws from."""
        if self.size == 1:
            return
        for variables in self.state[1:]:
            for target, source in zip(variables, self.state[0]):
                target.assign(source.value)
        if self.optimizers is None or not self.optimizers[0].built:
            return
        sources = _own_state(self.optimizers[0])
        for optimizer in self.optimizers[1:]:
            for target, source in zip(optimizer.variables, sources):
                target.assign(source.value if isinstance(source, keras.Variable) else source)


def _seed_states(tree):
    """The seed-generator state variables of the layers in `tree` (random layers, RNN cells,
    augmentation layers, a user's layers drawing from generators of their own)."""
    return [g.state for layer in tree for g in keras_random_layers.seed_generators(layer)]


def _own_state(optimizer):
    """`optimizer`'s variables but a learning-rate variable (its copies read that one)."""
    shared = optimizer.learning_rate if isinstance(optimizer.learning_rate, keras.Variable) else None
    return [v for v in optimizer.variables if v is not shared]


class _LearningRateOf:
    """A copy's learning rate: the variable of the optimizer it copies, read at each step."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def __call__(self):
        return self.optimizer.learning_rate


def layer_tree(holders):
    """Every layer in `holders` and nested in them (attributes, lists, dicts), in one order."""
    found, seen = [], set()

    def walk(value):
        if id(value) in seen:
            return
        seen.add(id(value))
        if isinstance(value, keras.layers.Layer):
            found.append(value)
            for attribute in vars(value).values():
                walk(attribute)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)

    for holder in holders:
        walk(holder)
    return found


# The whole batch's size while a data-parallel step is traced (`whole_batch_rows`).
_BATCH_ROWS = []


def batch_rows(value):
    """A batch's rows: those of `value`'s first tensor (a tensor, or a list / dict of them)."""
    return tf.shape(keras.tree.flatten(value)[0])[0]


@contextlib.contextmanager
def whole_batch_rows(n, one_copy=False):
    """While a step is traced: the batch has `n` rows, cut into `count` slices one sample
    apart, the first `n % count` one larger (`slice_sizes`); random layers find their rows.
    `one_copy`: copy 0 holds all `n` rows (inference runs copy 0 alone)."""
    _BATCH_ROWS.append((n, one_copy))
    try:
        yield
    finally:
        _BATCH_ROWS.pop()


def slice_sizes(n, count):
    """The sizes of `count` slices of `n` rows that differ by at most one, larger first."""
    return [(n + count - 1 - i) // count for i in range(count)]


# (index, count) while the forward of a pipeline's micro-batch is traced (`in_microbatch`).
_MICROBATCH = []


@contextlib.contextmanager
def in_microbatch(index, count):
    """While the forward of micro-batch `index` of `count` (of one copy's rows) is traced:
    random layers made to draw as one device (`draw_as_whole_batch`) take its rows."""
    _MICROBATCH.append((index, count))
    try:
        yield
    finally:
        _MICROBATCH.pop()


def draw_as_whole_batch(holders, index, count):
    """Makes replica `index` of `count` draw its random layers' numbers as one device does.

    One device draws one Dropout mask (Gaussian noise, ...) of the whole batch's shape;
    replica r holds rows [r*b, (r+1)*b) of it. Each replica's seed generator is in the same
    state as one device's, so in training each of its random layers is run on its rows
    placed in a batch of zeros of the whole batch's size, and keeps its rows of the output:
    the same numbers as one device, bit for bit, for D x the layer's (elementwise) work.
    An RNN cell's `dropout` / `recurrent_dropout` masks (LSTM, GRU, SimpleRNN: Keras's
    `DropoutRNNCell`) are drawn the same way, two draws per call of the layer; so are the
    draws of any other layer with SeedGenerators of its own (augmentation layers, a user's
    `keras.random` layer: `keras_random_layers.draws_from_own_generators`), in training,
    or always if its `call` takes no `training`. MixUp and CutMix, which mix rows, are refused.
    A pipeline runs each layer once per micro-batch (`in_microbatch`): micro-batch i takes
    its rows of the replica's, and draws from the seed state micro-batch 0 drew from, so
    the generator moves once per step, as on one device (M x the work again).
    """
    for layer in layer_tree(holders):
        own = keras_random_layers.draws_from_own_generators(layer)
        if (own or isinstance(layer, RANDOM_LAYERS)) and not getattr(layer.call, _WHOLE_BATCH, False):
            keras_random_layers.refuse_row_mixing(layer, "micro-batches or data-parallel copies")
            _draw_as_whole_batch(layer, "call", index, count)
        elif keras_random_layers.is_dropout_cell(layer):
            if not getattr(layer._create_dropout_mask, _WHOLE_BATCH, False):
                _draw_as_whole_batch(layer, "_create_dropout_mask", index, count)


def draws_in_training(layer):
    """Whether `layer`'s training forward draws random numbers (a rate that is not zero)."""
    if isinstance(layer, RANDOM_LAYERS):
        return bool(getattr(layer, "rate", 1))
    if keras_random_layers.draws_from_own_generators(layer):
        return True
    cell = getattr(layer, "cell", layer)  # an RNN layer (LSTM, GRU, ...) draws through its cell
    return keras_random_layers.is_dropout_cell(cell) and bool(cell.dropout or cell.recurrent_dropout)


def _share(n, index, count):
    """(offset, size) of slice `index` of `n` rows cut into `count` (`slice_sizes`)."""
    offset = index * (n // count) + tf.minimum(index, n % count)
    return offset, n // count + tf.cast(index < n % count, n.dtype)


def _draw_as_whole_batch(layer, method, index, count):
    """Wraps `layer.<method>` (a layer's `call(inputs, training, ...)`, or a cell's
    `_create_dropout_mask(step_input, rate)`) to draw on the whole batch's rows."""
    original = getattr(layer, method)
    seed = _SeedPerStep(layer)
    # Dropout and its kin draw in training only; another layer whose `call` takes no
    # `training` draws whenever it is called.
    takes_training = "training" in inspect.signature(original).parameters
    default = not takes_training and not isinstance(layer, RANDOM_LAYERS)

    def whole_batch(inputs, *args, **kwargs):
        if method == "call":
            training = kwargs.get("training", args[0] if args and isinstance(layer, RANDOM_LAYERS) else None)
            if training is None:
                training = default
            if isinstance(training, bool) and not training:
                return original(inputs, *args, **kwargs)
        if not tf.is_tensor(inputs):
            raise keras_random_layers.one_line(
                StrategyError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) draws random numbers from an input "
                    f"that is not one tensor ({type(inputs).__name__}): tfscale cannot give each copy or "
                    "micro-batch its rows of one device's draws. Give it one tensor."
                )
            )
        rows = tf.shape(inputs)[0]
        micro, micros = _MICROBATCH[-1] if _MICROBATCH else (0, 1)
        whole, one_copy = _BATCH_ROWS[-1] if _BATCH_ROWS else (None, False)
        n = count * micros * rows if whole is None else tf.cast(whole, rows.dtype)
        offset, mine = (0, n) if one_copy else _share(n, index, count)
        offset += _share(mine, micro, micros)[0]
        seed.draw(micro)
        return keras_random_layers.run_on_rows(
            lambda whole: original(whole, *args, **kwargs), inputs, offset, n
        )

    setattr(whole_batch, _WHOLE_BATCH, True)
    # Layers track the attributes they are given; a bound method is not state, so bypass that.
    object.__setattr__(layer, method, whole_batch)


class _SeedPerStep:
    """Micro-batch 0 notes the seed state it draws from; a later one draws from it again.

    A layer may draw more than once per call (an RNN cell: its input mask, then its
    recurrent mask): only the first draw of each micro-batch notes or restores the state,
    and the later ones move on from it as on one device. Automatic control dependencies run
    the reads and assignments of the generator's state in the order they are traced, and a
    pipeline traces a layer's micro-batches in order.
    """

    def __init__(self, layer):
        self.layer = layer
        self.first_seed = []  # the seed state micro-batch 0 of the step being traced drew from
        self.micro = None  # the micro-batch of the last draw traced

    def draw(self, micro):
        generators = keras_random_layers.seed_generators(self.layer)  # Dropout(rate=0) has none
        first_of_micro, self.micro = micro != self.micro, micro
        if not generators or not first_of_micro:
            return
        if micro == 0:
            self.first_seed[:] = [tf.identity(g.state.value) for g in generators]
        elif not self.first_seed:
            raise StrategyError(
                f"Layer {self.layer.name!r} ran micro-batch {micro} before micro-batch 0 in one step; "
                "its random numbers would differ from one device's (a tfscale bug: please report it)."
            )
        else:
            for generator, state in zip(generators, self.first_seed, strict=True):
                generator.state.assign(state)


def _gather_sparse(index, gradients, devices, summed):
    """Each sparse gradient of `index`: every replica's rows, concatenated in replica order.

    As the tape adds sparse gradients: the optimizer gets the whole batch's rows, in batch
    order, as on one device (`_gradients`); a sum of dense rows would change Adam's update.
    """
    for r, device in enumerate(devices):
        with tf.device(device), tf.name_scope("data_parallel/all_reduce"):
            for i in index:
                summed[r][i] = _gradients.add_n([gs[i] for gs in gradients])


def _position_keys(variables):
    """Each variable's device position within its replica: the order its device first appears."""
    order = {}
    for v in variables:
        order.setdefault(device_key(variable_device(v)), len(order))
    return [order[device_key(variable_device(v))] for v in variables]


class SyncedReplicas:
    """Mixin for a `keras.Model` with data-parallel replicas (`self._data_parallel()`).

    When the first step of a compiled model runs (after the callbacks' `on_train_begin`,
    where a backup is restored), the replicas take replica 0's `trainable` flags, layers
    that cannot train exactly on 1/D of the batch are refused, and the replicas'
    optimizers are made; replica 0 (the model Keras saves and restores) is copied into
    the others before the first step of each `fit`, and after `set_weights` and
    `load_weights`.
    """

    def _data_parallel(self):
        raise NotImplementedError

    def _prepare_replicas(self):
        """Called by `fit`: the next step starts by copying replica 0 into the others."""
        self._tfscale_sync_pending = True

    def make_train_function(self, force=False):
        super().make_train_function(force=force)
        function = self.train_function  # Keras 3 sets it (and returns nothing)
        if self._data_parallel().size == 1 or getattr(function, "_tfscale_syncs", False):
            return function
        prepared = []  # Once per train function: Keras makes a new one at each compile.

        def synced(iterator):
            replicas = self._data_parallel()
            if not prepared:
                replicas.follow_trainable()
                replicas.check_layers()
                replicas.make_optimizers(self.optimizer)
                self._tfscale_sync_pending = True
                prepared.append(True)
            if getattr(self, "_tfscale_sync_pending", True):
                replicas.sync()
                self._tfscale_sync_pending = False
            elif getattr(self, "_tfscale_seeds_pending", False):
                replicas.sync_seeds()
            self._tfscale_seeds_pending = False
            return function(iterator)

        synced._tfscale_syncs = True
        self.train_function = synced
        return synced

    def make_test_function(self, force=False):
        super().make_test_function(force=force)
        self.test_function = self._moving_seeds(self.test_function)
        return self.test_function

    def make_predict_function(self, force=False):
        super().make_predict_function(force=force)
        self.predict_function = self._moving_seeds(self.predict_function)
        return self.predict_function

    def _moving_seeds(self, function):
        """`function` (evaluate's or predict's step), noting that it ran: it runs replica 0
        only, whose seed generators may move (an RNN with dropout draws its masks in
        inference too, as Keras's `RNN.call` does), so the next training step copies replica
        0's seed states into the others (`Replicas.sync_seeds`)."""
        if self._data_parallel().size == 1 or getattr(function, "_tfscale_notes_seeds", False):
            return function

        def noting(*args, **kwargs):
            self._tfscale_seeds_pending = True
            return function(*args, **kwargs)

        noting._tfscale_notes_seeds = True
        return noting

    def set_weights(self, weights):
        super().set_weights(weights)
        self._data_parallel().sync()
