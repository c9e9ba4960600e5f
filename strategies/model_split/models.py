"""The Keras model classes a split returns: ordinary Sequential / functional models, plus
device placement of each layer's call and of the optimizer's slot variables."""

import contextlib
import itertools

import keras
import numpy as np
import tensorflow as tf

from tfscale.compat import keras_compile_loss
from tfscale.compat.keras_mask import get_keras_mask, set_keras_mask
from tfscale.compat.keras_optimizer_clip import clip_norm_by_groups
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._loss_split import one_reduction as _reduction
from tfscale.strategies._loss_split import slice_weights
from tfscale.strategies._parts import merge
from tfscale.strategies._placement import on_device, place_slots_with_variables
from tfscale.strategies._replicas import (
    Replicas,
    SyncedReplicas,
    batch_rows,
    draw_as_whole_batch,
    slice_sizes,
    whole_batch_rows,
)
from tfscale.strategies.model_split.layers import ModelSplitError, ShardGroup

__all__ = ["DataParallelSplit", "SplitFunctional", "SplitSequential"]


# Optimizers whose update of a weight reads the whole weight (its norm or its shape): on
# each shard of a tensor-split weight alone, it would compute something else.
_WHOLE_WEIGHT_OPTIMIZERS = {
    "Adafactor": "its second moments are factored over each weight's rows and columns and its "
    "step scales with the weight's RMS",
    "Lamb": "its trust ratio divides each weight's norm by the norm of its update",
    "Muon": "it orthogonalises each weight's whole update matrix and scales it by the weight's shape",
}


def _shard_groups(models):
    """{id(shard variable): key shared by the shards of one weight} over `models`' layers."""
    groups = {}
    for model in models:
        for layer in model.layers:
            for group in getattr(layer, "shard_groups", ()):
                groups.update({id(v): id(group.variables[0]) for v in group.variables})
    return groups


def fit_optimizer_to_shards(model_name, optimizer, models):
    """Refuses an optimizer that needs whole weights, and clips by whole-weight norms.

    A no-op for models without tensor-split layers (a layer split holds whole weights).

    Raises:
        ModelSplitError: `optimizer` (or the one a `LossScaleOptimizer` wraps) updates a
            weight from the whole weight (`_WHOLE_WEIGHT_OPTIMIZERS`).
    """
    groups = _shard_groups(models)
    if not groups:
        return
    for candidate in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        for name, why in _WHOLE_WEIGHT_OPTIMIZERS.items():
            cls = getattr(keras.optimizers, name, None)
            if cls is not None and isinstance(candidate, cls):
                raise ModelSplitError(
                    f"Cannot train tensor-split model {model_name!r} with {name}: {why}, and tensor "
                    "split holds each weight as shards on separate devices. Expected an optimizer "
                    "that updates each number on its own (SGD, Adam, AdamW, RMSprop, Adagrad, "
                    "Adadelta, Adamax, Nadam, Ftrl, Lion), or layer split (no tensor_parallel)."
                )
    clip_norm_by_groups(optimizer, lambda variable: groups.get(id(variable)))


def _unsplit_layout(model):
    """`model.weights` as the unsplit model holds them: a whole weight's variable, or the
    `ShardGroup` of a tensor-split weight where its first shard is."""
    groups = {
        id(v): g for layer in model.layers for g in getattr(layer, "shard_groups", ()) for v in g.variables
    }
    layout, seen = [], set()
    for variable in model.weights:
        group = groups.get(id(variable))
        if group is None:
            layout.append(variable)
        elif id(group) not in seen:
            seen.add(id(group))
            layout.append(group)
    return layout


class _PlacedSlots:
    """Mixin of the split models: `compile` places the optimizer's slots with their variables
    and fits the optimizer to tensor-split weights (`fit_optimizer_to_shards`);
    `get_weights` / `set_weights` and `save_weights` use the unsplit model's layout (a
    tensor-split weight is one array, as in the model that was split), and `load_weights`
    also takes a weights file of that model (`remember_origin`)."""

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        fit_optimizer_to_shards(self.name, self.optimizer, [self])
        place_slots_with_variables(self.optimizer)

    # Keras restores the compilation of a saved model only when a model that overrides
    # `compile` overrides these two as well; ours do what Keras's own do, through `compile`.
    def get_compile_config(self):
        return super().get_compile_config()

    def compile_from_config(self, config):
        self.compile(**keras.saving.deserialize_keras_object(config))
        if self.built:
            self.optimizer.build(self.trainable_variables)  # for the saved optimizer state

    def remember_origin(self, origin):
        """`origin` (`_parts.Origin`): how to build the unsplit model, for `load_weights`."""
        object.__setattr__(self, "_tfscale_origin", origin)

    def get_weights(self):
        """The weights as numpy arrays, in the unsplit model's `get_weights()` layout."""
        return [
            item.gather() if isinstance(item, ShardGroup) else item.numpy() for item in _unsplit_layout(self)
        ]

    def set_weights(self, weights):
        """Sets the weights from arrays in the unsplit model's `get_weights()` layout."""
        layout, weights = _unsplit_layout(self), list(weights)
        want = [tuple(item.shape) for item in layout]
        if [tuple(np.shape(w)) for w in weights] != want:
            raise ModelSplitError(
                f"Invalid value for argument `weights` of model {self.name!r}: received "
                f"{len(weights)} arrays of shapes {[tuple(np.shape(w)) for w in weights]}. Expected "
                f"{len(want)} arrays of shapes {want} (the unsplit model's get_weights() layout)."
            )
        for item, value in zip(layout, weights):
            item.assign(value)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Writes the weights file of the unsplit model (tensor-split weights gathered whole).

        The file loads into the user's own model, as a layer split's (and a pipeline's) does.
        """
        origin = getattr(self, "_tfscale_origin", None)
        if origin is None or not any(getattr(layer, "shard_groups", ()) for layer in self.layers):
            return super().save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)
        return merge(origin, self).save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a weights file of this split model, or of the unsplit model it was split from."""
        try:
            return super().load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        except ValueError:
            origin = getattr(self, "_tfscale_origin", None)
            if origin is None or not any(getattr(layer, "shard_groups", ()) for layer in self.layers):
                raise
        # A file of the unsplit model: loaded into that model, then split into this one.
        unsplit = merge(origin, self)
        unsplit.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self.set_weights(unsplit.get_weights())


@keras.saving.register_keras_serializable(package="tfscale")
class SplitSequential(_PlacedSlots, keras.Sequential):
    """A `keras.Sequential` whose layer i runs under `tf.device(placement[i])`.

    Its layers (classes, order, weights) are those of the model it was split from, so its
    `save_weights` file has the same layout and loads into that model, and back. Its output
    has the structure of that model's (`output_structure`: e.g. `{"score": 0}` for a chain
    whose one output is a dict), so `loss` / `loss_weights` by output name still apply.
    """

    def __init__(self, layers, placement=None, name=None, output_structure=None):
        super().__init__(layers, name=name)
        self._placement = tuple(placement) if placement else None
        # Untracked: Keras would wrap a dict in a TrackedDict, a type the losses do not match.
        object.__setattr__(self, "_output_structure", output_structure)

    def get_config(self):
        placement = list(self._placement) if self._placement else None
        return {**super().get_config(), "placement": placement, "output_structure": self._output_structure}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """The split model again, each layer made (and its variables created) on its device."""
        config = dict(config)
        placement, structure = config.pop("placement", None), config.pop("output_structure", None)
        input_config, *layer_configs = config["layers"]
        first = keras.saving.deserialize_keras_object(input_config, custom_objects=custom_objects)
        layers, x = [], first.output
        for layer_config, device in zip(layer_configs, placement or [None] * len(layer_configs)):
            with tf.device(device) if device else contextlib.nullcontext():
                layer = keras.saving.deserialize_keras_object(layer_config, custom_objects=custom_objects)
                x = layer(x)
            layers.append(layer)
        return cls([first, *layers], placement=placement, name=config["name"], output_structure=structure)

    def _structured(self, output):
        if self._output_structure is None:
            return output
        return keras.tree.pack_sequence_as(self._output_structure, [output])

    def compute_output_spec(self, inputs, training=None, mask=None, **kwargs):
        return self._structured(super().compute_output_spec(inputs, training=training, mask=mask, **kwargs))

    def call(self, inputs, training=None, mask=None):
        return self._structured(self._call_placed(inputs, training=training, mask=mask))

    def _call_placed(self, inputs, training=None, mask=None):
        if self._placement is None:
            return super().call(inputs, training=training, mask=mask)
        x = inputs
        if mask is not None:
            set_keras_mask(x, mask)
        # One hop per group of consecutive layers on a device; `training` reaches each layer
        # through Keras' call context, the Keras mask across the hop (`_hop`).
        steps = zip(self.layers, self._placement)
        for device, group in itertools.groupby(steps, key=lambda step: step[1]):
            x = _hop(device, [layer for layer, _ in group], x)
        return x


def _hop(device, layers, x):
    """`layers` run one after another on `device`, the Keras mask carried in and out.

    Keras carries a mask from layer to layer as an attribute of the tensors; the hop
    (`on_device`) makes new tensors, so the mask goes in as an input (no gradient) and the
    mask the last layer attached comes back out, exactly as Keras would propagate it.
    """
    mask = get_keras_mask(x)
    out_mask = []

    def run(x, *masks):
        if masks:
            set_keras_mask(x, masks[0])
        for layer in layers:
            x = layer(x)
        out_mask.append(get_keras_mask(x))
        return x

    y = on_device(device, run, x, *([] if mask is None else [mask]))
    if out_mask[-1] is not None:
        set_keras_mask(y, out_mask[-1])
    return y


@keras.saving.register_keras_serializable(package="tfscale")
class SplitFunctional(_PlacedSlots, keras.Model):
    """A functional `keras.Model` (built from inputs and outputs) with placed optimizer slots."""


class _Others:
    """Replicas 1..D-1 of a data-parallel split: a plain holder, so Keras tracks only replica 0."""

    def __init__(self, models, replicas):
        self.models = list(models)
        self.replicas = replicas


def _split(data, d):
    """`data` (a tensor, or a dict / list of them) cut into D slices along the batch.

    A batch that D does not divide (a dataset's last batch) gives slices one sample apart,
    the first ones larger (`slice_sizes`; maybe empty), as the pipeline cuts its batches.
    """
    leaves = keras.tree.flatten(data)
    sizes = tf.stack(slice_sizes(tf.shape(leaves[0])[0], d))
    pieces = [tf.split(t, sizes, num=d) for t in leaves]
    return [keras.tree.pack_sequence_as(data, [p[r] for p in pieces]) for r in range(d)]


def _masked_slice_weights(reduction, y_preds):
    """Slice weights of a masked output under a mean loss, or None (no mask, other reduction).

    Keras averages a masked loss over the valid (unmasked) steps of the whole batch; each
    replica averages over its own, so slice r weighs valid_r / valid_total (not 1/D).
    """
    if keras.tree.is_nested(y_preds[0]):
        if any(get_keras_mask(t) is not None for y in y_preds for t in keras.tree.flatten(y)):
            raise StrategyError(
                "A data-parallel split of a model with several (or dict / list) outputs cannot "
                "weigh a masked output's loss by its valid steps. Expected unmasked outputs, one "
                "tensor output, or data_parallel=1."
            )
        return None
    masks = [get_keras_mask(y) for y in y_preds]
    if reduction not in ("sum_over_batch_size", "mean") or any(m is None for m in masks):
        return None
    counts = [tf.reduce_sum(tf.cast(m, y.dtype)) for m, y in zip(masks, y_preds)]
    total = tf.add_n(counts)
    return [tf.math.divide_no_nan(c, total) for c in counts]


class DataParallelSplit(SyncedReplicas, keras.Model):
    """D copies of a split model, each on its own group of devices, trained as one model.

    Replica r takes the r-th 1/D of every batch; each part's gradients are summed over the
    D replicas (`tfscale.strategies._replicas`) before every replica applies them. It
    predicts, evaluates and saves as replica 0 (`primary`), the split model with the user's
    layers: its weights files load into the user's model.
    """

    def __init__(self, models, name=None):
        super().__init__(name=name or f"{models[0].name}_data_parallel")
        self.primary = models[0]
        self._others = _Others(models[1:], Replicas([[m] for m in models]))
        for r, model in enumerate(models):
            draw_as_whole_batch([model], r, len(models))  # Dropout's masks: one device's
        self.built = True
        replicas, make = self._others.replicas, self._others.replicas.make_optimizers

        def make_fitted(optimizer):
            # The other replicas' optimizers (copies of this one) clip whole weights too.
            make(optimizer)
            for copy in replicas.optimizers[1:]:
                fit_optimizer_to_shards(self.name, copy, self.replica_models)

        replicas.make_optimizers = make_fitted

    @property
    def replica_models(self):
        return [self.primary, *self._others.models]

    def _data_parallel(self):
        return self._others.replicas

    def call(self, inputs, training=False):
        # Copy 0 alone: a layer drawing in inference too takes all rows of one device's draws.
        with whole_batch_rows(batch_rows(inputs), one_copy=True):
            return self.primary(inputs, training=training)

    def compile(self, *args, **kwargs):
        super().compile(*args, **kwargs)
        _reduction(self.loss)
        fit_optimizer_to_shards(self.name, self.optimizer, self.replica_models)
        place_slots_with_variables(self.optimizer)
        self.primary.optimizer = self.optimizer  # its weights file holds the optimizer

    def fit(self, *args, **kwargs):
        self._prepare_replicas()
        return super().fit(*args, **kwargs)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch = batch_rows(x)
        with whole_batch_rows(batch):  # Dropout's rows of one device's mask, in any slice size
            return self._train_step(x, y, sample_weight, batch)

    def _train_step(self, x, y, sample_weight, batch):
        models, d = self.replica_models, len(self.replica_models)
        xs, ys = _split(x, d), _split(y, d)
        sws = None if sample_weight is None else _split(sample_weight, d)
        reduction = _reduction(self.loss)
        loss_object = keras_compile_loss.compiled_loss(self)
        # Every replica's forward first: a masked output's slices weigh by their valid steps.
        tapes, y_preds = [tf.GradientTape() for _ in models], []
        for tape, model, x_r in zip(tapes, models, xs):
            with tape:
                y_preds.append(model(x_r, training=True))
        rows = [batch_rows(x_r) for x_r in xs]
        weights = _masked_slice_weights(reduction, y_preds) or slice_weights(reduction, sws, d, sizes=rows)
        gradients, terms = [], []
        for r, (tape, model, y_pred) in enumerate(zip(tapes, models, y_preds)):
            with tape:  # the same tape again: the loss is recorded after its forward
                # An empty slice (a batch smaller than D) adds nothing: its mean loss is 0 / 0.
                value = (
                    tf.cond(
                        rows[r] > 0,
                        lambda r=r, y_pred=y_pred: loss_object(
                            ys[r], y_pred, None if sws is None else sws[r]
                        ),
                        lambda: tf.constant(0.0),
                    )
                    * weights[r]
                )
                # The weight penalty: 1/D from each replica adds up to one penalty.
                # The penalties: each copy's share is its slice's share of the batch (a weight
                # penalty is the same in every copy, an activity penalty a per-sample mean), and
                # an empty slice's (a mean over no sample) adds nothing.
                penalty = tf.add_n(model.losses) if model.losses else None
                if penalty is not None:
                    dtype = penalty.dtype
                    share = tf.cast(rows[r], dtype) / tf.cast(batch, dtype)
                    penalty = tf.cond(
                        rows[r] > 0, lambda p=penalty, s=share: p * s, lambda t=dtype: tf.zeros((), t)
                    )
                total = value if penalty is None else value + penalty
                scaled = self.optimizer.scale_loss(total)
            grads = tape.gradient(scaled, model.trainable_variables)
            gradients.append(
                [tf.zeros_like(v) if g is None else g for g, v in zip(grads, model.trainable_variables)]
            )
            # Logged as differentiated: the replicas' penalties (weight penalties are equal,
            # activity penalties are per-sample means of equal slices) average to the batch's.
            terms.append(total)
        replicas = self._data_parallel()
        replicas.apply(replicas.all_reduce(gradients))
        keras_compile_loss.update_loss_tracker(self, tf.add_n(terms), batch)
        if keras.tree.is_nested(y_preds[0]):  # several outputs, or one in a dict or list
            leaves = zip(*(keras.tree.flatten(y) for y in y_preds))
            y_pred = keras.tree.pack_sequence_as(y_preds[0], [tf.concat(ls, axis=0) for ls in leaves])
            return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        y_pred = tf.concat(y_preds, axis=0)
        masks = [get_keras_mask(y) for y in y_preds]
        if all(m is not None for m in masks):  # masked metrics see the batch's mask
            set_keras_mask(y_pred, tf.concat(masks, axis=0))
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def get_weights(self):
        """Replica 0's weights, in the unsplit model's layout."""
        return self.primary.get_weights()

    def set_weights(self, weights):
        """Sets every replica's weights from arrays in the unsplit model's layout."""
        self.primary.set_weights(weights)
        self._data_parallel().sync()

    def save(self, filepath, overwrite=True, **kwargs):
        """Saves the unsplit model (what `strategy.merge(model)` gives: the user's architecture,
        replica 0's weights, compiled with this model's optimizer state) as Keras does.

        `keras.models.load_model` then gives the user's one-device model, which continues
        training as this one would; split it again to train it with data_parallel.
        """
        from tfscale.strategies import _parts

        # Its D copies are not one Keras model: the unsplit model they all hold is.
        origin = self.primary._tfscale_origin
        merged = _parts.merge(origin, self.primary, compiled=self)
        return merged.save(filepath, overwrite=overwrite, **kwargs)

    def get_layer(self, name=None, index=None):
        """A layer of replica 0 (the user's layers), by name or index: e.g. to freeze it."""
        return self.primary.get_layer(name=name, index=index)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Writes replica 0's weights file (the user's model's layout)."""
        return self.primary.save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a weights file of the user's model into every replica."""
        result = self.primary.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self._data_parallel().sync()
        return result
