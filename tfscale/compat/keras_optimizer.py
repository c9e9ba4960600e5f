"""Keras 3 optimizers under `MirroredStrategy` / `MultiWorkerMirroredStrategy`: one-device semantics.

Checked on Keras 3.15.1 with TensorFlow 2.21 (and the same code is in Keras 3.0 to
3.15): `keras.src.backend.tensorflow.optimizer.TFOptimizer` all-reduces gradients
inside `_backend_update_step`, i.e. *after* `BaseOptimizer._backend_apply_gradients`
has clipped them, with `replica_context.all_reduce(SUM, grads)` and no
`CommunicationOptions`. Under distribution that means:

1. `clipnorm` / `global_clipnorm` / `clipvalue` clip each replica's partial gradient
   (1/N of the loss) rather than the summed gradient: training differs from one
   device. tf.keras 2 refused clipping under a strategy for exactly this reason
   (tensorflow/tensorflow#33929); Keras 3 allows it and clips in the wrong place.
2. `gradient_accumulation_steps=k` crashes in `fit` ("merge_call called while
   defining a new graph"): the all-reduce, weight decay and the accumulator
   updates each call `merge_call` inside the optimizer's `ops.cond`
   (keras-team/keras#20582, open); so does `ema_overwrite_frequency`.
3. `LossScaleOptimizer` decides "finite?" on replica 0's *local* gradients (its
   comment assumes they were already all-reduced), so replicas can disagree.
4. No `CommunicationOptions` (packing, timeout, implementation) ever reach the
   gradient all-reduce, and there is no way to compress it.

The fix, applied only where those private methods exist unfixed (`needed()`):
gradients are all-reduced first, in replica context, by launching the strategy's own
collective ops directly (`CollectiveAllReduce._all_reduce`, the path TensorFlow
itself takes when `merge_call` is disabled), with the strategy's `Communication`
options (read through `tfscale.compat.tf_communication`). Everything after that (clip,
weight decay, `update_step`, EMA) runs on identical values on every replica and
updates only the replica's own copy of each variable (Keras creates model and slot
variables with aggregation NONE, which TensorFlow updates locally in replica
context), so no `merge_call` is left and `ops.cond` works. Gradient accumulators are
ON_READ/SUM variables: each replica sums its own micro-batch gradients with no
communication, the update step all-reduces the accumulated sum once, and a
checkpoint (or `tfscale.callbacks.BackupAndRestore`) saves the cross-replica sum
and restores sum/num_replicas per replica, which all-reduces to the same total.

`update_step` is reached through the optimizer's own `_backend_update_step`, as Keras
reaches it (ZeRO's sharded update too), and TFOptimizer's version (all-reduce, then
`merge_call`) becomes the local loop there: a subclass's per-step work before its
`super()` call runs once a step, as on one device. Nadam advances its momentum-schedule
product `_u_product` in that override (Keras 3.15.1, keras/src/optimizers/nadam.py).
Calling `update_step` directly, as this fix once did, left `_u_product` at 1.0: the
first update divided by `1 - 1.0` and the loss was NaN. Reproducer: Dense(1) on 4
inputs, Nadam(0.02), mse, 16 samples in batches of 8, `MirroredStrategy` on 2 CPUs after
`apply_optimizer_fixes()`: loss NaN and `_u_product` 1.0 after 2 steps, against 2.0668 and
0.2271 on one device (stock Keras under the strategy gives the same as one device).
Gate: this fix's own; `test_mirrored_nadam_matches_one_device` fails without it.

`tfscale.strategies.get("mirrored" | "multi_worker")` applies it; users who build
those strategies by hand call `tfscale.compat.apply_optimizer_fixes()` once.
"""

import keras
import tensorflow as tf

from tfscale.compat import keras_optimizer_zero as zero
from tfscale.compat import tf_communication
from tfscale.compat.keras_multi_worker import _version_tuple

__all__ = ["all_reduce_exact", "apply", "is_applied", "needed"]

# First Keras release whose TF optimizer clips after the all-reduce and accumulates
# without merge_call; None while upstream is unfixed.
_FIXED_IN = None
_ACCUMULATOR = "gradient_accumulator"
_state = {"applied": False, "originals": {}}


def needed(version=None):
    """True when this Keras version all-reduces after clipping and accumulates with merge_call."""
    version = _version_tuple(version or keras.__version__)
    if version < (3,):
        return False
    return _FIXED_IN is None or version < _version_tuple(_FIXED_IN)


def is_applied():
    """True once `apply()` has patched this process's Keras optimizers."""
    return _state["applied"]


def _modules():
    from keras.src.backend.tensorflow import optimizer as tf_optimizer
    from keras.src.optimizers import base_optimizer, loss_scale_optimizer

    return tf_optimizer, base_optimizer, loss_scale_optimizer


def _data_parallel(strategy):
    # Also at 1 replica (mirrored on one device, a 1-worker multi_worker job, an elastic job
    # shrunk to one): Keras's own path crashes there with gradient accumulation (the
    # all-reduce inside its `cond`), and the fixed path is the same arithmetic.
    return isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy))


def _active():
    """True in a replica context of a Mirrored/MWMS step being traced."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return False
    return _data_parallel(tf.distribute.get_strategy()) and not tf.executing_eagerly()


def _collective_ops(strategy):
    extended = strategy.extended
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return extended._cross_device_ops
    return extended._collective_ops  # MirroredStrategy keeps CollectiveAllReduce here.


def _launch(strategy, values, options):
    replica_id = tf.distribute.get_replica_context()._replica_id
    return _collective_ops(strategy)._all_reduce(tf.distribute.ReduceOp.SUM, values, replica_id, options)


def _options(strategy):
    return tf_communication.compression_dtype(strategy), tf_communication.options(strategy)


def _zero_step(optimizer):
    strategy = tf.distribute.get_strategy()
    launcher = _collective_ops(strategy)._launchers[tf.distribute.get_replica_context()._replica_id]
    return zero.Step(optimizer, launcher, _options(strategy)[1], all_reduce_sum)


def all_reduce_exact(values):
    """SUM-all-reduces dense `values` across replicas, as they are (no compression).

    In the replica context of a traced Mirrored/MWMS step (`_active()`), with the
    strategy's communication options; for small exact values such as loss denominators
    (`keras_loss_denominator`).
    """
    strategy = tf.distribute.get_strategy()
    return _launch(strategy, list(values), _options(strategy)[1])


def all_reduce_sum(grads):
    """SUM-all-reduces `grads` (no None) across replicas with the strategy's options."""
    strategy = tf.distribute.get_strategy()
    wire, options = _options(strategy)
    grads = list(grads)
    dense = [i for i, g in enumerate(grads) if not isinstance(g, tf.IndexedSlices)]
    if wire is None or not dense:
        return _launch(strategy, grads, options)
    # Sparse (IndexedSlices) gradients are all-gathered, not summed: sent as they are.
    sparse = [i for i in range(len(grads)) if i not in dense]
    dense_grads = [grads[i] for i in dense]
    compressed = _launch(strategy, [tf.cast(g, wire) for g in dense_grads], options)
    # Every replica receives the same reduced values, so every replica takes the same
    # branch: an fp16 overflow (inf) redoes this step's all-reduce uncompressed
    # instead of writing inf into the weights.
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(c)) for c in compressed])
    dense_reduced = tf.cond(
        finite,
        lambda: [tf.cast(c, g.dtype) for c, g in zip(compressed, dense_grads)],
        lambda: _launch(strategy, dense_grads, options),
    )
    reduced = dict(zip(dense, dense_reduced))
    if sparse:
        reduced.update(zip(sparse, _launch(strategy, [grads[i] for i in sparse], options)))
    return [reduced[i] for i in range(len(grads))]


def _reduce(optimizer, grads):
    if getattr(optimizer, "_tfscale_grads_reduced", False):
        return list(grads)  # LossScaleOptimizer all-reduced them to decide "finite?".
    return all_reduce_sum(grads)


def _local_update(optimizer, grads, variables):
    """Clip, weight decay and update_step on this replica's copies (grads already summed)."""
    if zero.active(optimizer):
        step = _zero_step(optimizer)
        step.update(step.clipped_shards(grads, variables), variables)
        step.gather(variables)
        return
    _, base_optimizer, _ = _modules()
    grads = optimizer._clip_gradients(grads)
    base_optimizer.BaseOptimizer._apply_weight_decay(optimizer, variables)
    optimizer._backend_update_step(grads, variables, optimizer.learning_rate)


def _make_backend_update_step(original):
    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if not _active():
            return original(self, grads, trainable_variables, learning_rate)
        # Reached from `_backend_apply_gradients` below, through a subclass's override
        # (Nadam's): the gradients are summed already, each replica updates its own copies.
        for grad, variable in zip(grads, trainable_variables):
            self.update_step(grad, variable, learning_rate)

    return _backend_update_step


def _accumulate(optimizer, grads, variables, apply):
    """Adds `grads` into the accumulators; on every k-th micro-step `apply(totals, k)` first
    and the accumulators start again from zero."""
    steps = optimizer.gradient_accumulation_steps
    accumulators = [optimizer._accumulated_gradients[optimizer._get_variable_index(v)] for v in variables]
    is_update_step = (optimizer._iterations + 1) % steps == 0

    def update():
        apply([g + tf.cast(a.value, g.dtype) for g, a in zip(grads, accumulators)], steps)
        for a in accumulators:
            a.assign(tf.zeros(a.shape, a.dtype))

    def accumulate():
        for g, a in zip(grads, accumulators):
            a.assign(a.value + tf.cast(g, a.dtype))

    tf.cond(is_update_step, update, accumulate)


def _apply_accumulating_sharded(optimizer, grads, variables):
    """Stage 2: each micro-step's summed gradient is sliced at once; the shards accumulate."""
    step = _zero_step(optimizer)

    def apply(totals, steps):
        step.update(step.clip_shards([t / steps for t in totals], variables), variables)
        step.gather(variables)

    shards = step.shard_gradients(_reduce(optimizer, grads), variables)
    # Keras adds a sparse gradient into its accumulator densely: so do the shards.
    shards = [tf.convert_to_tensor(s) if isinstance(s, tf.IndexedSlices) else s for s in shards]
    _accumulate(optimizer, shards, variables, apply)


def _apply_accumulating(optimizer, grads, variables):
    if zero.active(optimizer) >= 2:
        return _apply_accumulating_sharded(optimizer, grads, variables)

    def apply(totals, steps):
        # The only communication of the k micro-steps: the local sums, all-reduced once.
        _local_update(optimizer, [t / steps for t in _reduce(optimizer, totals)], variables)

    _accumulate(optimizer, grads, variables, apply)


def _overwrite_with_average(optimizer):
    for var, average in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average):
        if average is not None:
            var.assign(average)


def _make_backend_apply_gradients(original):
    def _backend_apply_gradients(self, grads, trainable_variables):
        if not _active():
            return original(self, grads, trainable_variables)
        stage = zero.stage_of(tf.distribute.get_strategy())
        if stage:  # Also an optimizer with no slots: refused if its rule is not verified.
            zero.check_optimizer(self, stage)
        if self.gradient_accumulation_steps:
            _apply_accumulating(self, list(grads), list(trainable_variables))
        else:
            _local_update(self, _reduce(self, grads), list(trainable_variables))
        if self.use_ema and zero.active(self):
            step = _zero_step(self)
            step.ema()
            if self.ema_overwrite_frequency:
                overwrite = (self.iterations + 1) % self.ema_overwrite_frequency == 0
                tf.cond(overwrite, step.overwrite_with_average, lambda: None)
        elif self.use_ema:
            self._update_model_variables_moving_average(self._trainable_variables)
            if self.ema_overwrite_frequency:
                overwrite = (self.iterations + 1) % self.ema_overwrite_frequency == 0
                tf.cond(overwrite, lambda: _overwrite_with_average(self), lambda: None)

    return _backend_apply_gradients


def _make_add_variable_from_reference(original):
    def add_variable_from_reference(self, reference_variable, name=None, initializer="zeros"):
        stage = (
            zero.stage_of(self._distribution_strategy) if _data_parallel(self._distribution_strategy) else 0
        )
        if stage and (name != _ACCUMULATOR or stage >= 2):
            return zero.add_sharded_slot(self, reference_variable, name, initializer, stage)
        if name != _ACCUMULATOR or not _data_parallel(self._distribution_strategy):
            return original(self, reference_variable, name=name, initializer=initializer)
        # ON_READ/SUM: replica-local sums, saved as their cross-replica total.
        colocate = (
            reference_variable.value if isinstance(reference_variable, keras.Variable) else reference_variable
        )
        with self._distribution_strategy.extended.colocate_vars_with(colocate):
            with keras.name_scope(self.name, caller=self):
                variable = keras.Variable(
                    initializer=keras.initializers.get(initializer),
                    shape=reference_variable.shape,
                    dtype=reference_variable.dtype,
                    trainable=False,
                    aggregation="sum",
                    synchronization="on_read",
                    name=f"{reference_variable.path.replace('/', '_')}_{name}",
                )
        self._track_variable(variable)
        return variable

    return add_variable_from_reference


def _make_overwrite_with_average_value(original):
    def _overwrite_model_variables_with_average_value(self, trainable_variables):
        if not zero.active(self):
            return original(self, trainable_variables)
        return zero.overwrite_with_average_value(self, trainable_variables)

    return _overwrite_model_variables_with_average_value


def _make_save_own_variables(original):
    def save_own_variables(self, store):
        if not zero.has_shards(self):
            return original(self, store)
        return zero.save_own_variables(self, store)

    return save_own_variables


def _make_load_own_variables(original):
    def load_own_variables(self, store):
        if not zero.has_shards(self) or not zero.load_own_variables(self, store):
            return original(self, store)  # (counts that differ: Keras warns and loads nothing)
        return None

    return load_own_variables


def _make_loss_scale_tf_apply(original):
    def _tf_apply(self, grads, trainable_variables=None):
        if not _active():
            return original(self, grads, trainable_variables)
        strategy = tf.distribute.get_strategy()
        accumulating = bool(self.inner_optimizer.gradient_accumulation_steps)
        if accumulating:
            # "Finite?" must be one decision for all replicas; micro-steps share no
            # gradients, so the replicas' non-finite counts are summed instead (one
            # 4-byte launch per micro-step, only under loss scaling).
            bad = tf.add_n([tf.reduce_sum(tf.cast(~tf.math.is_finite(g), tf.float32)) for g in grads])
            finite = tf.equal(_launch(strategy, [bad], strategy.extended._communication_options)[0], 0.0)
        else:
            grads = all_reduce_sum(list(grads))
            finite = self.check_finite(grads)  # Same reduced values, same decision everywhere.

        def cross_replica(distribution, grads, finite):
            def apply_finite():
                # The inner optimizer's `iterations` update needs merge_call, which only
                # works in a cond taken in cross-replica context (as stock Keras does).
                self.inner_optimizer._tfscale_grads_reduced = not accumulating
                try:
                    distribution.extended.call_for_each_replica(
                        self._stateful_handle_finite_grads, args=(grads, trainable_variables)
                    )
                finally:
                    self.inner_optimizer._tfscale_grads_reduced = False

            first = distribution.experimental_local_results(finite)[0]
            tf.cond(first, apply_finite, self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(cross_replica, args=(grads, finite))

    return _tf_apply


def apply():
    """Patches Keras 3's TF optimizers for one-device semantics under data parallelism.

    Idempotent. Does nothing where upstream is fixed.

    Returns:
        True if the fix is in effect after the call, False if not needed.
    """
    if _state["applied"]:
        return True
    if not needed():
        return False
    tf_optimizer, base_optimizer, loss_scale_optimizer = _modules()
    cls, lso = tf_optimizer.TFOptimizer, loss_scale_optimizer.LossScaleOptimizer
    base = base_optimizer.BaseOptimizer
    originals = {
        (cls, "_backend_apply_gradients"): cls._backend_apply_gradients,
        (cls, "_backend_update_step"): cls._backend_update_step,
        (cls, "add_variable_from_reference"): cls.add_variable_from_reference,
        (lso, "_tf_apply"): lso._tf_apply,
        (
            cls,
            "_overwrite_model_variables_with_average_value",
        ): cls._overwrite_model_variables_with_average_value,
    }
    cls._backend_apply_gradients = _make_backend_apply_gradients(cls._backend_apply_gradients)
    cls._backend_update_step = _make_backend_update_step(cls._backend_update_step)
    cls.add_variable_from_reference = _make_add_variable_from_reference(cls.add_variable_from_reference)
    lso._tf_apply = _make_loss_scale_tf_apply(lso._tf_apply)
    cls._overwrite_model_variables_with_average_value = _make_overwrite_with_average_value(
        cls._overwrite_model_variables_with_average_value
    )
    # On the base class: LossScaleOptimizer, which wraps a TFOptimizer, inherits them too.
    for name, make in (
        ("save_own_variables", _make_save_own_variables),
        ("load_own_variables", _make_load_own_variables),
    ):
        originals[base, name] = getattr(base, name)
        setattr(base, name, make(getattr(base, name)))
    _state["originals"] = originals
    _state["applied"] = True
    return True


def _unapply():
    """Restores stock Keras (tests compare against it)."""
    for (owner, name), original in _state["originals"].items():
        setattr(owner, name, original)
    _state["applied"] = False
