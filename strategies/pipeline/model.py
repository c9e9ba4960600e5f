"""`PipelinedModel`: a `keras.Model` whose `train_step` runs a pipeline schedule over stages."""

import keras
import tensorflow as tf

from tfscale.compat import keras_compile_loss
from tfscale.compat.keras_mask import get_keras_mask, set_keras_mask
from tfscale.strategies import _gradients, _replicas
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._loss_split import one_reduction as _loss_reduction
from tfscale.strategies._loss_split import slice_weights as _microbatch_weights
from tfscale.strategies._placement import place_slots_with_variables
from tfscale.strategies.model_split.graph import flat_inputs
from tfscale.strategies.pipeline import step as _step
from tfscale.strategies.pipeline.graph import GraphStage

__all__ = ["PipelinedModel"]


class _Plan:
    """The stages and schedule; a plain object so Keras does not track the layers twice."""

    def __init__(
        self,
        stages,
        schedule,
        num_microbatches,
        partition,
        origin,
        *,
        replicas,
        virtual_stages,
        batch_norm=None,
    ):
        self.stages = stages
        # A graph's stages take and give lists of tensors (`pipeline.graph`); a chain's one.
        self.graph = isinstance(stages[0], GraphStage)
        self.batch_norm = batch_norm  # `DeferredBatchNorm`, `EmptyMicrobatchGuard` (Keras's updates) or None
        self.virtual_stages = virtual_stages
        self.replicas = replicas  # per data-parallel replica, its stages (replica 0: `stages`)
        self.data_parallel = _replicas.Replicas(
            [[layer for stage in r for layer in stage.layers] for r in replicas]
        )
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.partition = partition
        self.origin = origin  # how to rebuild the user's model (`PipelineStrategy.merge`)


def _split_even(x, parts):
    """Splits along the batch into `parts` pieces whose sizes differ by at most one.

    `x`: a tensor, or a list / dict of them (a graph's inputs, several outputs' targets):
    each piece has `x`'s structure.
    """
    leaves = keras.tree.flatten(x)
    n = tf.shape(leaves[0])[0]
    sizes = tf.stack([(n + parts - 1 - i) // parts for i in range(parts)])
    pieces = [tf.split(t, sizes, num=parts) for t in leaves]
    return [keras.tree.pack_sequence_as(x, [p[i] for p in pieces]) for i in range(parts)]


class PipelinedModel(_replicas.SyncedReplicas, keras.Model):
    """A Keras model trained by a pipeline schedule; build it with `PipelineStrategy.split`.

    It holds `unsplit_model`, the same network as the user's model (same class, layer names
    and weights file layout) with each stage's variables on that stage's device.
    `compile`, `fit`, `evaluate`, `predict`, callbacks and `save_weights`/`load_weights`
    work as for any Keras model; the weights files are those of the unsplit model.
    """

    def __init__(
        self,
        unsplit_model,
        stages,
        schedule,
        num_microbatches,
        partition,
        *,
        virtual_stages,
        origin=None,
        batch_norm=None,
        replicas=None,
    ):
        super().__init__(name=f"{unsplit_model.name}_pipelined")
        self.unsplit_model = unsplit_model
        self._plan = _Plan(
            stages,
            schedule,
            num_microbatches,
            partition,
            origin,
            batch_norm=batch_norm,
            virtual_stages=virtual_stages,
            replicas=replicas or [stages],
        )
        self.built = True

    @property
    def output_names(self):
        """A graph's output names: Keras names several outputs' losses and metrics by them.

        (A chain's pipeline has none: Keras names its one output's loss and metrics without one.)
        """
        plan = self.__dict__.get("_plan")
        if plan is None or not plan.graph:
            raise AttributeError("output_names")
        return self.unsplit_model.output_names

    @property
    def partition(self):
        """Per stage: device, layer names, parameter count and bytes (the chosen split)."""
        return self._plan.partition

    @property
    def stages(self):
        return self._plan.stages

    @property
    def replicas(self):
        """Per data-parallel replica, its list of stages (replica 0 is `stages`)."""
        return self._plan.replicas

    @property
    def schedule(self):
        return self._plan.schedule

    @property
    def num_microbatches(self):
        return self._plan.num_microbatches

    @property
    def virtual_stages(self):
        """V: chunks of the chain per device (`stages` holds S x V of them)."""
        return self._plan.virtual_stages

    def call(self, inputs, training=False):
        inputs = self._stage_input(inputs)
        parts = _split_even(inputs, self.num_microbatches)
        # A layer that draws in inference too takes its micro-batch's rows of one device's
        # numbers (`_replicas.draw_as_whole_batch`): it needs the whole batch's size.
        with _replicas.whole_batch_rows(_replicas.batch_rows(inputs), one_copy=True):
            outputs = _step.forward_only(self.stages, parts, training=training)
        with tf.device(self.stages[-1].device):
            return _concat_masked(outputs)

    def compile(self, *args, jit_compile=False, **kwargs):
        """`keras.Model.compile`; XLA is refused because it would fuse the stages' devices."""
        if jit_compile is True:
            raise StrategyError(
                "Invalid value for argument `jit_compile`. Received: jit_compile=True. Expected "
                "False: XLA compiles one cluster and would undo the per-stage device placement."
            )
        super().compile(*args, jit_compile=False, **kwargs)
        _loss_reduction(self.loss)
        place_slots_with_variables(self.optimizer)
        # The unsplit model's weights file holds its optimizer: share ours, so the files
        # written by save_weights (and BackupAndRestore) are those of the unsplit model.
        self.unsplit_model.optimizer = self.optimizer

    def fit(self, *args, **kwargs):
        self._prepare_replicas()
        return super().fit(*args, **kwargs)

    def _data_parallel(self):
        return self._plan.data_parallel

    def _stage_input(self, x):
        """What the first stage takes: `x` (a chain), or a graph's inputs as a flat list."""
        if not self._plan.graph:
            return x
        return flat_inputs(self.unsplit_model, x)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # With one micro-batch per copy, each copy's Dropout draws its rows of one device's
        # mask (`_replicas.draw_as_whole_batch`): it needs the whole batch's size.
        with _replicas.whole_batch_rows(_replicas.batch_rows(x)):
            return self._train_step(x, y, sample_weight)

    def _train_step(self, x, y, sample_weight):
        m, replicas = self.num_microbatches, self.replicas
        d = len(replicas)
        batch = _replicas.batch_rows(x)
        # Replica r takes the r-th 1/D of the batch, cut into M micro-batches on its devices;
        # a batch that D x M does not divide gives slices one sample apart (maybe empty).
        xs = _slices(self._stage_input(x), d, m, [stages[0].device for stages in replicas])
        ys = _slices(y, d, m, [stages[-1].device for stages in replicas])
        sws = _slices(sample_weight, d, m, [stages[-1].device for stages in replicas])
        reduction = _loss_reduction(self.loss)
        with tf.device(replicas[0][-1].device):
            # Sample weights weigh the slices under "mean_with_sample_weight" only; there, one
            # array for every output (`_one_weight`). Per-output weights reach the loss as given.
            weighted = sws is not None and reduction == "mean_with_sample_weight"
            flat_sws = [_one_weight(w) for ws in sws for w in ws] if weighted else None
            sizes = [_replicas.batch_rows(piece) for pieces in xs for piece in pieces]
            weights = _microbatch_weights(reduction, flat_sws, d * m, sizes=sizes)
        loss_object, terms, shares = keras_compile_loss.compiled_loss(self), [], []

        def loss_fn_of(r):
            def loss_fn(i, y_pred):
                w = None if sws is None else sws[r][i]
                # Keras returns an empty micro-batch's loss unreduced when its size is static.
                value = tf.reduce_sum(loss_object(ys[r][i], y_pred, w))
                mask = _output_mask(y_pred)
                if mask is not None and reduction != "sum":
                    # Keras divides by the batch's valid steps: known once every micro-batch
                    # is done, so the gradients are divided by their total at the end.
                    share = _masked_divisor(reduction, mask, w)
                    shares.append(share)
                    value = value * share
                else:
                    value = value * weights[r * m + i]
                terms.append(value)
                return self.optimizer.scale_loss(value)

            return loss_fn

        y_preds, gradients = [], []
        for r, stages in enumerate(replicas):

            def run(stages=stages, r=r):
                return _step.run_batch(stages, self.schedule, xs[r], loss_fn_of(r), self.virtual_stages)

            batch_norm = self._plan.batch_norm  # deferred with one replica (see PipelineStrategy.split)
            outputs, _, grads = batch_norm.run(run, m) if batch_norm else run()
            y_preds += outputs
            gradients.append([g for gs in grads for g in gs])
        summed = self._plan.data_parallel.all_reduce(gradients)
        with tf.device(replicas[0][-1].device):
            # 1 / (the batch's valid steps, in units of `_masked_divisor`); 0 if none is valid.
            factor = tf.math.divide_no_nan(1.0, tf.add_n(shares)) if shares else None
        regularization = self._finish_gradients(summed, factor)
        if d == 1:
            variables = [v for stage in replicas[0] for v in stage.trainable_variables]
            self.optimizer.apply_gradients(zip(summed[0], variables))
        else:
            self._plan.data_parallel.apply(summed)
        with tf.device(replicas[0][-1].device):
            loss = tf.add_n(terms)
            loss = loss if factor is None else loss * factor
            loss = tf.add_n([loss, *regularization])
            y_pred = _concat_masked(y_preds)
        keras_compile_loss.update_loss_tracker(self, loss, batch)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _finish_gradients(self, summed, factor):
        """Per replica, in place: the masked loss's division, then the weight penalty's gradient.

        Returns the penalty values (replica 0's).
        """
        regularization = []
        for r, stages in enumerate(self.replicas):
            # After the sum: the weight penalty counts once, as on one device.
            per_stage = _regroup(summed[r], stages)
            for stage in stages if factor is not None else []:
                with tf.device(stage.device):
                    grads = per_stage[stage.index]
                    per_stage[stage.index] = [_gradients.scale(g, tf.cast(factor, g.dtype)) for g in grads]
            values = self._regularization(per_stage, stages)
            regularization = regularization or values
            summed[r] = [g for gs in per_stage for g in gs]
        return regularization

    def _regularization(self, gradients, stages):
        """Adds each stage's weight-regularisation gradient (on its device); returns the losses."""
        losses = []
        for stage in stages:
            with tf.device(stage.device), tf.GradientTape() as tape:
                stage_losses = [loss for layer in stage.layers for loss in layer.losses]
                if not stage_losses:
                    continue
                value = tf.add_n(stage_losses)
                scaled = self.optimizer.scale_loss(value)
            with tf.device(stage.device):
                # On the stage's device: outside it the penalty's gradient would read the
                # weights onto the default device (across hosts, 2x the weights per step).
                grads = tape.gradient(scaled, stage.trainable_variables)
                gradients[stage.index] = [_gradients.add(a, g) for a, g in zip(gradients[stage.index], grads)]
            losses.append(value)
        return losses

    def trace_step(self, x, y, sample_weight=None):
        """Profiles one real training step; returns its measured `PipelineTrace`.

        The weights and the optimizer advance by exactly one step (a warm-up step that
        traces the graph first is undone). `tfscale.strategies.pipeline.plot_timeline(trace,
        path)` draws it.
        """
        from tfscale.strategies.pipeline import timeline

        return timeline.trace_train_step(self, x, y, sample_weight=sample_weight)

    def plan_report(self, x, y, sample_weight=None):
        """Memory per device and bytes sent between devices per step, measured and by formula.

        Profiles one step and traces one more on the global batch `x`, `y`; the weights and
        the optimizer are left as they were. Returns a `tfscale.strategies.pipeline.PlanReport`
        (`.table()`, `.to_json()`, `.max_device_bytes`).
        """
        from tfscale.strategies.pipeline import plan

        return plan.plan_report(self, x, y, sample_weight=sample_weight)

    def get_layer(self, name=None, index=None):
        """A layer of the unsplit model (replica 0's), by name or index: e.g. to freeze it."""
        return self.unsplit_model.get_layer(name=name, index=index)

    def save(self, filepath, overwrite=True, zipped=None, **kwargs):
        """Saves the unsplit model (the user's architecture, trained weights) as Keras does.

        `keras.models.load_model` then gives the user's one-device model, compiled as this
        one is and holding its optimizer state (what `strategy.merge` gives), so `fit` on it
        continues as plain Keras's loaded model does; split it again to train it as a pipeline.
        """
        from tfscale.strategies import _parts

        if self._plan.origin is None:
            return self.unsplit_model.save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)
        # The unsplit model alone is not compiled: a loaded one could not continue.
        merged = _parts.merge(self._plan.origin, self.unsplit_model, compiled=self)
        return merged.save(filepath, overwrite=overwrite, zipped=zipped, **kwargs)

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Writes the unsplit model's weights file (loadable by the user's original model)."""
        return self.unsplit_model.save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a weights file of the unsplit model (or written by `save_weights`)."""
        result = self.unsplit_model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self._plan.data_parallel.sync()
        return result


def _slices(value, data_parallel, num_microbatches, devices):
    """Per replica, the M micro-batches of its 1/D of `value`, each cut on its device.

    Sizes differ by at most one sample when D x M does not divide the batch (a final
    partial batch): the loss weights follow the sizes (`_loss_split.slice_weights`).
    """
    if value is None:
        return None
    with tf.device(devices[0]):
        pieces = _split_even(value, data_parallel) if data_parallel > 1 else [value]
    out = []
    for piece, device in zip(pieces, devices):
        with tf.device(device):
            out.append(_split_even(piece, num_microbatches))
    return out


def _one_weight(sample_weight):
    """A slice's sample weights: one tensor (every output's, when they share them)."""
    leaves = keras.tree.flatten(sample_weight)
    if len(leaves) > 1:
        raise StrategyError(
            "A pipeline weighs each micro-batch once for all the model's outputs: sample weights per "
            "output cannot be combined under reduction='mean_with_sample_weight'. Expected one "
            "sample_weight array, or the losses' default reduction ('sum_over_batch_size')."
        )
    return leaves[0]


def _output_mask(y_pred):
    """The Keras mask of a one-tensor output (None if none); several outputs with one are refused."""
    if tf.is_tensor(y_pred):
        return get_keras_mask(y_pred)
    positions = [i for i, y in enumerate(keras.tree.flatten(y_pred)) if get_keras_mask(y) is not None]
    if positions:
        raise StrategyError(
            f"The model's outputs {positions} (flat positions) carry a Keras mask: a pipeline divides a "
            "masked loss by the batch's valid steps for one output only. Expected one output, or "
            "outputs without a mask (a layer split, get('model_split'), takes several masked outputs)."
        )
    return None


def _masked_divisor(reduction, mask, sample_weight):
    """What Keras divides a slice's masked loss sum by, over the steps of one sample.

    Keras's mean of a masked loss is sum(loss * weight) / sum(mask) (`sum(weight * mask)`
    for "mean_with_sample_weight"); per micro-batch that divisor, scaled by one sample's
    steps so that it stays near the micro-batch's share of the batch.
    """
    mask = tf.cast(mask, tf.float32)
    steps = tf.cast(tf.reduce_prod(tf.shape(mask)[1:]), tf.float32)
    if reduction == "mean_with_sample_weight" and sample_weight is not None:
        weight = tf.cast(sample_weight, tf.float32)
        for _ in range(len(mask.shape) - len(weight.shape)):
            weight = tf.expand_dims(weight, -1)  # per sample, over its steps (as Keras expands it)
        mask = mask * weight
    return tf.reduce_sum(mask) / steps


def _concat_masked(outputs):
    """The micro-batches' outputs as one batch, with their Keras masks (if any) joined too.

    Each output may be a structure (a graph's several outputs): joined tensor by tensor.
    """
    flat = [keras.tree.flatten(o) for o in outputs]
    joined = []
    for pieces in zip(*flat):
        y = tf.concat(pieces, axis=0)
        masks = [get_keras_mask(o) for o in pieces]
        if all(mask is not None for mask in masks):
            set_keras_mask(y, tf.concat(masks, axis=0))
        joined.append(y)
    return keras.tree.pack_sequence_as(outputs[0], joined)


def _regroup(flat, stages):
    """A flat list of gradients back into one list per stage."""
    out, start = [], 0
    for stage in stages:
        count = len(stage.trainable_variables)
        out.append(flat[start : start + count])
        start += count
    return out
