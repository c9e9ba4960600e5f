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

import keras
import numpy as np
import tensorflow as tf

from tfscale.strategies import _gradients
from tfscale.strategies._devices import device_key
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._placement import place_slots_with_variables, variable_device

__all__ = ["Replicas", "check_data_parallel", "group_devices"]


def check_data_parallel(data_parallel, per_replica, devices_here, *, count_argument):
    """D after checking that D replicas of `per_replica` devices fit in `devices_here`.

    Raises:
        StrategyError: D not a positive int, or D x per_replica more than the devices.
    """
    if isinstance(data_parallel, bool) or not isinstance(data_parallel, int) or data_parallel < 1:
        raise StrategyError(
            f"Invalid value for argument `data_parallel`. Received: data_parallel={data_parallel!r}. "
            "Expected a positive integer."
        )
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
    """D copies of one model's trainable variables, their optimizers, and the gradient sum.

    Args:
        variables: per replica, the trainable variables in one fixed order (the same
            layer and weight at the same index in every replica).
    """

    def __init__(self, variables):
        self.variables = [list(vs) for vs in variables]
        self.size = len(self.variables)
        positions = [_position_keys(vs) for vs in self.variables]
        if any(len(vs) != len(self.variables[0]) for vs in self.variables):
            raise StrategyError("Replicas of a data-parallel model must have the same variables.")
        # Variable i is at device position `positions[0][i]` in every replica (same part).
        self.positions = positions[0]
        self.optimizers = None  # replicas 1..D-1; replica 0 uses the model's own optimizer

    def make_optimizers(self, optimizer):
        """Gives replicas 1..D-1 an optimizer like `optimizer` (slots beside their variables)."""
        self.optimizers = [optimizer]
        for variables in self.variables[1:]:
            copy = type(optimizer).from_config(optimizer.get_config())
            place_slots_with_variables(copy)
            copy.build(variables)
            self.optimizers.append(copy)

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

    def sync(self):
        """Copies replica 0's variables (and optimizer state, once built) into the others."""
        if self.size == 1:
            return
        for variables in self.variables[1:]:
            for target, source in zip(variables, self.variables[0]):
                target.assign(source.value)
        if self.optimizers is None or not self.optimizers[0].built:
            return
        for optimizer in self.optimizers[1:]:
            for target, source in zip(optimizer.variables, self.optimizers[0].variables):
                target.assign(source.value if isinstance(source, keras.Variable) else source)


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

    Makes the replicas' optimizers when `fit` starts, and copies replica 0 (the model Keras
    saves and restores) into the others before the first step of each `fit` -- after the
    callbacks' `on_train_begin`, where a backup is restored -- and after `set_weights` and
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

        def synced(iterator):
            replicas = self._data_parallel()
            if replicas.optimizers is None or replicas.optimizers[0] is not self.optimizer:
                replicas.make_optimizers(self.optimizer)  # first step, or compiled again
                self._tfscale_sync_pending = True
            if getattr(self, "_tfscale_sync_pending", True):
                replicas.sync()
                self._tfscale_sync_pending = False
            return function(iterator)

        synced._tfscale_syncs = True
        self.train_function = synced
        return synced

    def set_weights(self, weights):
        super().set_weights(weights)
        self._data_parallel().sync()
