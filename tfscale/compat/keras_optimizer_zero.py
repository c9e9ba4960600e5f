"""ZeRO stages 1 and 2 for Keras 3 optimizers under `MirroredStrategy`: slots kept as 1/N shards.

Checked on Keras 3.15.1 / TensorFlow 2.21. Keras creates every optimizer slot with
`add_variable_from_reference` (private to the TF backend's `TFOptimizer`) at the variable's
full shape, and `MirroredStrategy` keeps one full copy a replica. With a ZeRO stage set on
the strategy (`set_stage`), `keras_optimizer`'s patched methods call this module instead:

- A slot is created flattened and padded to `shard = ceil(size / N)` elements
  (`N * shard - size` zeros of padding per variable, all on the last replica's shard), as
  a mirrored variable whose N components hold DIFFERENT values: replica r keeps elements
  `[r * shard, (r + 1) * shard)` of the flattened slot, on its own device (aggregation
  NONE, so TensorFlow updates only the local component in replica context).
- Beside its slots each variable gets a shard of the parameter (`..._zero_shard`, the
  "master" shard the update rule writes into: 1/N of the parameter's bytes).
- A step: gradients are summed over replicas (CPU collectives have no reduce-scatter --
  `CollectiveReduceScatterV2` has only an NCCL kernel -- so it is the strategy's
  all-reduce, then this replica's slice is taken: the same bytes on the wire as stage 0);
  clipping (stage 1: on the summed gradient, as Keras; stage 2: on the shards, each norm
  a sum of the shards' squares over replicas, one small all-reduce) and weight decay as
  Keras does them; then the user's optimizer's own `update_step(grad_shard,
  param_shard, lr)`, reached through its `_backend_update_step` as Keras reaches it (its
  slots are found through `_trainable_variables_indices`, where the shard is registered
  under its variable's index); then one all-gather of all updated parameter shards
  writes the full parameters into every replica's copy.
- Stage 2 also shards `gradient_accumulation_steps`'s accumulators: each micro-step's
  gradient is summed over replicas and only the shard is kept.

Only elementwise update rules shard exactly; `SHARDABLE` lists the classes checked (the
exact classes, not subclasses); anything else is refused before the first step.
Gradients that arrive as `tf.IndexedSlices` (an `Embedding`) stay sparse: Keras's update
rules treat a row that occurs twice as two rows (Adam squares each before they are added),
so a shard gets the elements of the summed slices that fall in its range, each as its own
entry, in order (`_slice_sparse`), and the update rule runs on those as Keras runs it on
the rows. Clipping then happens before slicing (Keras's own `_clip_gradients`, also at
stage 2), and stage 2's accumulators add them densely (as Keras's do).

Backups (`tfscale.callbacks.BackupAndRestore`) hold each sharded slot whole, at its
variable's shape and under the name Keras gives it at stage 0 (`full_shape`,
`join_shards`, `whole_value`), and leave out the parameter shards (`is_derived`: rewritten from the
parameter at every step). So a backup does not depend on the number of replicas or the
stage: `assign_full` cuts it into this job's shards on restore.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tfscale.errors import Error

__all__ = [
    "ATTRIBUTE",
    "SHARDABLE",
    "ZeroError",
    "assign_full",
    "components",
    "full_shape",
    "has_shards",
    "is_derived",
    "join_shards",
    "load_own_variables",
    "save_own_variables",
    "saved_variables",
    "set_stage",
    "stage_of",
    "whole_value",
]

ATTRIBUTE = "_tfscale_zero_stage"
SHARDABLE = (
    "SGD",
    "Adam",
    "AdamW",
    "RMSprop",
    "Adagrad",
    "Adadelta",
    "Adamax",
    "Nadam",
    "Lion",
    "Ftrl",
)
_STATE = "_tfscale_zero"


class ZeroError(Error):
    """A ZeRO stage that cannot run this model or optimizer (names it and what to do)."""


def stage_of(strategy):
    """The ZeRO stage set on `strategy` (0 if none)."""
    return getattr(strategy, ATTRIBUTE, 0)


def set_stage(strategy, stage):
    """Sets the ZeRO stage of `strategy` (read when its optimizers build their slots)."""
    setattr(strategy, ATTRIBUTE, stage)


def active(optimizer):
    """The ZeRO stage this optimizer's slots were built for (0: not sharded)."""
    return getattr(optimizer, _STATE, {}).get("stage", 0)


def check_optimizer(optimizer, stage):
    """`ZeroError` unless `optimizer`'s update rule is one this module shards exactly."""
    name = type(optimizer).__name__
    if type(optimizer).__module__.startswith("keras.") and name in SHARDABLE:
        return
    raise ZeroError(
        f"zero_stage={stage} cannot shard optimizer {name}: its update is not verified to be "
        f"elementwise. Expected one of {list(SHARDABLE)} (or a LossScaleOptimizer around one), or "
        "zero_stage=0."
    )


def _num_replicas(optimizer):
    return optimizer._distribution_strategy.num_replicas_in_sync


def _shard_size(reference, num_replicas):
    return max(1, math.ceil(reference.shape.num_elements() / num_replicas))


def _new_variable(optimizer, reference, name, initializer, shard):
    colocate = reference.value if isinstance(reference, keras.Variable) else reference
    with optimizer._distribution_strategy.extended.colocate_vars_with(colocate):
        with keras.name_scope(optimizer.name, caller=optimizer):
            variable = keras.Variable(
                initializer=keras.initializers.get(initializer),
                shape=(shard,),
                dtype=reference.dtype,
                trainable=False,
                name=f"{reference.path.replace('/', '_')}_{name}",
            )
    optimizer._track_variable(variable)
    return variable


def add_sharded_slot(optimizer, reference, name, initializer, stage):
    """A slot of `reference` kept as 1/N flattened shards, one per replica (see module doc)."""
    check_optimizer(optimizer, stage)
    state = optimizer.__dict__.setdefault(
        _STATE, {"stage": stage, "params": {}, "sharded": set(), "shapes": {}, "derived": set()}
    )
    shard = _shard_size(reference, _num_replicas(optimizer))
    key = optimizer._var_key(reference)
    if key not in state["params"]:
        param = _new_variable(optimizer, reference, "zero_shard", "zeros", shard)
        state["params"][key] = param
        state["sharded"].add(id(param))
        state["derived"].add(id(param))
    variable = _new_variable(optimizer, reference, name, initializer, shard)
    state["sharded"].add(id(variable))
    state["shapes"][id(variable)] = tuple(reference.shape)
    return variable


def is_sharded(optimizer, variable):
    """True for a variable this module created as 1/N shards."""
    return id(variable) in getattr(optimizer, _STATE, {}).get("sharded", ())


def _replica():
    context = tf.distribute.get_replica_context()
    return context, context.replica_id_in_sync_group, context.num_replicas_in_sync


def _slice(tensor, size, num_replicas, replica_id):
    """Replica `replica_id`'s shard of a `size`-element tensor. `size` is the variable's: a
    gradient's static shape can be unknown (e.g. out of LossScaleOptimizer's `tf.cond`)."""
    flat = tf.reshape(tf.convert_to_tensor(tensor), [size])
    shard = max(1, math.ceil(size / num_replicas))
    padded = tf.pad(flat, [[0, shard * num_replicas - size]])
    return tf.reshape(padded, [num_replicas, shard])[replica_id]


def _slice_sparse(slices, shape, num_replicas, replica_id):
    """Replica `replica_id`'s shard of a sparse gradient of a variable of `shape`: an
    `IndexedSlices` over the shard's elements, one entry per element of each row it got
    (repeated rows stay repeated, in order)."""
    size = shape.num_elements()
    row = size // shape[0]
    shard = max(1, math.ceil(size / num_replicas))
    values = tf.reshape(slices.values, [-1])
    first = tf.cast(slices.indices, tf.int64)[:, None] * row
    flat = tf.reshape(first + tf.range(row, dtype=tf.int64)[None, :], [-1])
    low = tf.cast(replica_id, tf.int64) * shard
    keep = (flat >= low) & (flat < low + shard)
    return tf.IndexedSlices(
        tf.boolean_mask(values, keep), tf.boolean_mask(flat, keep) - low, tf.constant([shard], tf.int64)
    )


def _gather(launcher, options, shards, references, *, replica_id, num_replicas):
    """Every replica's `shards`, concatenated in replica order: the full values, reshaped."""
    if not shards:
        return []
    # Collective ranks follow device names, not replica ids ("CPU:10" < "CPU:2"): the ids
    # travel too (4 bytes a replica) and put the rows back in replica order.
    ids = launcher._all_gather(tf.reshape(tf.cast(replica_id, tf.int32), [1]), options)
    order = tf.argsort(ids)
    out = {}
    for dtype in {s.dtype for s in shards}:
        members = [i for i, s in enumerate(shards) if s.dtype == dtype]
        packed = tf.concat([shards[i] for i in members], axis=0)
        rows = tf.gather(tf.reshape(launcher._all_gather(packed, options), [num_replicas, -1]), order)
        sizes = [shards[i].shape.num_elements() for i in members]
        for i, columns in zip(members, tf.split(rows, sizes, axis=1)):
            ref = references[i]
            full = tf.reshape(columns, [-1])[: ref.shape.num_elements()]
            out[i] = tf.reshape(full, ref.shape)
    return [out[i] for i in range(len(shards))]


def _squares(shards, sharded, reduce_sum):
    """Each gradient's sum of squares: shards' summed over replicas, whole ones local."""
    local = [tf.reduce_sum(tf.square(s)) for s in shards]
    if any(sharded):
        total = reduce_sum([tf.stack([q if m else tf.zeros_like(q) for q, m in zip(local, sharded)])])[0]
        return [total[i] if m else q for i, (q, m) in enumerate(zip(local, sharded))]
    return local


def _clip_shards(optimizer, shards, sharded, reduce_sum):
    """Keras's `_clip_gradients` on shards: every norm over the whole gradient."""
    if optimizer.clipnorm and optimizer.clipnorm > 0:
        clipped = []
        for s, l2sum in zip(shards, _squares(shards, sharded, reduce_sum)):
            positive = l2sum > 0  # tf.clip_by_norm's formula (Keras's _clip_by_norm)
            norm = tf.where(positive, tf.sqrt(tf.where(positive, l2sum, tf.ones_like(l2sum))), l2sum)
            clipped.append(s * optimizer.clipnorm / tf.maximum(norm, optimizer.clipnorm))
        return clipped
    if optimizer.global_clipnorm and optimizer.global_clipnorm > 0:
        norm = tf.sqrt(tf.add_n(_squares(shards, sharded, reduce_sum)))
        clip = optimizer.global_clipnorm
        scale = clip * tf.minimum(1.0 / norm, 1.0 / clip) + (norm - norm)
        return [s * scale for s in shards]
    if optimizer.clipvalue and optimizer.clipvalue > 0:
        return [tf.clip_by_value(s, -optimizer.clipvalue, optimizer.clipvalue) for s in shards]
    return shards


class Step:
    """One replica's ZeRO update inside a traced step (see the module doc)."""

    def __init__(self, optimizer, launcher, options, reduce_sum):
        self.optimizer = optimizer
        self.launcher = launcher
        self.options = options
        self.reduce_sum = reduce_sum
        self.params = getattr(optimizer, _STATE)["params"]
        _, self.replica_id, self.num_replicas = _replica()
        # The update rule finds its slots by the variable's index: each shard gets its
        # variable's (EMA averages are built before the indices exist, hence here).
        indices = optimizer._trainable_variables_indices
        for key, param in self.params.items():
            indices[optimizer._var_key(param)] = indices[key]

    def param_shard(self, variable):
        return self.params.get(self.optimizer._var_key(variable))

    def slice(self, tensor, variable):
        """This replica's shard of `tensor`, a value of `variable` or of its gradient."""
        if isinstance(tensor, tf.IndexedSlices):
            return _slice_sparse(tensor, variable.shape, self.num_replicas, self.replica_id)
        return _slice(tensor, variable.shape.num_elements(), self.num_replicas, self.replica_id)

    def shard_gradients(self, reduced, variables):
        """This replica's slices of summed gradients (sparse stays sparse; None stays None)."""
        return [
            self.slice(g, v) if self.param_shard(v) is not None else g for g, v in zip(reduced, variables)
        ]

    def clipped_shards(self, reduced, variables):
        """Clipped shards of summed gradients: stage 1 clips before slicing (Keras's own
        `_clip_gradients`), stage 2 after (norms summed over the replicas' shards), except
        with a sparse gradient (Keras's norms of those count a repeated row twice)."""
        if active(self.optimizer) >= 2 and not any(isinstance(g, tf.IndexedSlices) for g in reduced):
            return self.clip_shards(self.shard_gradients(reduced, variables), variables)
        return self.shard_gradients(self.optimizer._clip_gradients(reduced), variables)

    def clip_shards(self, shards, variables):
        sharded = [self.param_shard(v) is not None for v in variables]
        return _clip_shards(self.optimizer, shards, sharded, self.reduce_sum)

    def update(self, grads, variables):
        """`update_step` on the shards (weight decay first, on the full local copies)."""
        from keras.src.optimizers import base_optimizer

        optimizer = self.optimizer
        base_optimizer.BaseOptimizer._apply_weight_decay(optimizer, variables)
        targets = []
        for variable in variables:
            shard = self.param_shard(variable)
            if shard is None:  # No slots (SGD without momentum): nothing to shard.
                targets.append(variable)
                continue
            shard.assign(self.slice(variable, variable))
            targets.append(shard)
        # Through the optimizer's own `_backend_update_step` (keras_optimizer makes it the
        # local loop): Nadam advances its `_u_product` there, once a step.
        optimizer._backend_update_step(grads, targets, optimizer.learning_rate)

    def ema(self):
        optimizer = self.optimizer
        shards = [self.param_shard(v) for v in optimizer._trainable_variables]
        targets = [v if s is None else s for v, s in zip(optimizer._trainable_variables, shards)]
        optimizer._update_model_variables_moving_average(targets)

    def gather(self, variables):
        """Writes every replica's updated shards into the full parameters of this replica."""
        pairs = [(v, self.param_shard(v)) for v in variables if self.param_shard(v) is not None]
        self._write([v for v, _ in pairs], [s.value for _, s in pairs])

    def overwrite_with_average(self):
        optimizer = self.optimizer
        pairs = [
            (v, a)
            for v, a in zip(optimizer._trainable_variables, optimizer._model_variables_moving_average)
            if a is not None
        ]
        sharded = [(v, a) for v, a in pairs if is_sharded(optimizer, a)]
        for v, a in pairs:
            if not is_sharded(optimizer, a):
                v.assign(a)
        self._write([v for v, _ in sharded], [a.value for _, a in sharded])

    def _write(self, variables, shards):
        full = _gather(
            self.launcher,
            self.options,
            shards,
            variables,
            replica_id=self.replica_id,
            num_replicas=self.num_replicas,
        )
        for variable, value in zip(variables, full):
            variable.assign(value)


def full_value(variable, reference):
    """A sharded variable's full value, read in cross-replica context from its components."""
    components = [tf.reshape(c, [-1]) for c in variable.value.values]
    return tf.reshape(tf.concat(components, axis=0)[: reference.shape.num_elements()], reference.shape)


def overwrite_with_average_value(optimizer, trainable_variables):
    """`finalize_variable_values` under EMA: each sharded average put back together."""
    for var, average in zip(trainable_variables, optimizer._model_variables_moving_average):
        if average is not None:
            var.assign(full_value(average, var) if is_sharded(optimizer, average) else average)


# --- backups: each sharded slot whole, at its variable's shape ---------------------------


def _bookkeeping(optimizer):
    """The ZeRO state of `optimizer`, or of the optimizer a LossScaleOptimizer wraps ({} if none)."""
    for o in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if o is not None and _STATE in o.__dict__:
            return o.__dict__[_STATE]
    return {}


def has_shards(optimizer):
    """True for an optimizer (or a LossScaleOptimizer around one) with ZeRO-sharded slots."""
    return bool(_bookkeeping(optimizer))


def is_derived(optimizer, variable):
    """True for a parameter shard: rewritten from the parameter at every step, so a backup
    leaves it out (and a backup of a stage-0 job lines up with one of a ZeRO job)."""
    return id(variable) in _bookkeeping(optimizer).get("derived", ())


def full_shape(optimizer, variable):
    """The shape of the variable a sharded slot belongs to; None for any other variable."""
    return _bookkeeping(optimizer).get("shapes", {}).get(id(variable))


def saved_variables(optimizer):
    """`optimizer.variables` as Keras has them at stage 0: the parameter shards left out."""
    return [v for v in optimizer.variables if not is_derived(optimizer, v)]


def whole_value(optimizer, variable):
    """`variable`'s value as stage 0 holds it (a sharded slot's shards put together), on the host."""
    shape = full_shape(optimizer, variable)
    if shape is None:
        return variable.numpy()
    return join_shards([c.numpy() for c in components(variable)], shape)


def save_own_variables(optimizer, store):
    """Keras's `save_own_variables` in stage 0's layout: `model.save` files load anywhere."""
    for i, variable in enumerate(saved_variables(optimizer)):
        store[str(i)] = whole_value(optimizer, variable)


def load_own_variables(optimizer, store):
    """Keras's `load_own_variables` from stage 0's layout, each slot cut into this job's shards.
    False (nothing loaded) where the counts differ, for Keras's own warning."""
    variables = saved_variables(optimizer)
    if len(store.keys()) != len(variables):
        return False
    for i, variable in enumerate(variables):
        if full_shape(optimizer, variable) is None:
            variable.assign(store[str(i)])
        else:
            assign_full(variable, store[str(i)])
    return True


def components(variable):
    """A sharded variable's per-replica parts, in replica order (each on its own device)."""
    return list(variable.value.values)


def join_shards(arrays, shape):
    """The whole value from every replica's shard (host arrays, replica order): padding dropped."""
    flat = np.concatenate([np.reshape(a, [-1]) for a in arrays])
    return flat[: math.prod(shape)].reshape(shape)


def assign_full(variable, value):
    """Cuts a whole value into this job's shards: replica r's part gets elements
    `[r * shard, (r + 1) * shard)` of the flattened value, zero-padded at the end."""
    parts = components(variable)
    shard = parts[0].shape.num_elements()
    flat = np.reshape(np.asarray(value), [-1])
    if flat.size > shard * len(parts):
        raise ValueError(f"{flat.size} elements do not fit {len(parts)} shards of {shard}")
    flat = np.pad(flat, [(0, shard * len(parts) - flat.size)])
    for r, part in enumerate(parts):
        part.assign(flat[r * shard : (r + 1) * shard])
