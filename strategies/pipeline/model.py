"""`PipelinedModel`: a `keras.Model` whose `train_step` runs a pipeline schedule over stages."""

import inspect
import math

import keras
import tensorflow as tf

from tfscale.compat import keras_compile_loss
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._placement import place_slots_with_variables
from tfscale.strategies.pipeline import step as _step

__all__ = ["PipelinedModel"]

_MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


class _Plan:
    """The stages and schedule; a plain object so Keras does not track the layers twice."""

    def __init__(
        self, stages, schedule, num_microbatches, partition, origin, *, batch_norm=None, virtual_stages=1
    ):
        self.stages = stages
        self.batch_norm = batch_norm  # a `DeferredBatchNorm`, or None: Keras's own updates
        self.virtual_stages = virtual_stages
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.partition = partition
        self.origin = origin  # how to rebuild the user's model (`PipelineStrategy.merge`)


def _split_even(x, parts):
    """Splits along the batch into `parts` pieces whose sizes differ by at most one."""
    n = tf.shape(x)[0]
    sizes = tf.stack([(n + parts - 1 - i) // parts for i in range(parts)])
    return tf.split(x, sizes, num=parts)


def _split_exact(value, parts):
    return None if value is None else tf.split(value, parts)


def _loss_reduction(loss):
    if loss is None:
        raise StrategyError(
            "A pipelined model needs `loss` in `compile()`. Received: loss=None. Expected a "
            "Keras loss (name, function or `keras.losses.Loss`)."
        )
    if isinstance(loss, (list, tuple, dict)):
        raise StrategyError(
            f"Invalid value for argument `loss`. Received: loss={loss!r}. Expected a single "
            "loss: a pipeline is a chain with one output."
        )
    reduction = getattr(loss, "reduction", "sum_over_batch_size") if isinstance(loss, keras.Loss) else None
    reduction = reduction or "sum_over_batch_size"
    if reduction not in (*_MEAN_REDUCTIONS, "sum", "mean_with_sample_weight"):
        raise StrategyError(
            f"Invalid loss reduction for a pipeline. Received: reduction={reduction!r}. Expected "
            "'sum_over_batch_size', 'mean', 'sum' or 'mean_with_sample_weight' (a scalar loss)."
        )
    return reduction


def _microbatch_weights(reduction, sample_weights, num_microbatches):
    """w_i with sum_i w_i * loss(micro-batch i) == loss(batch) for equal micro-batches."""
    if reduction == "sum":
        return [1.0] * num_microbatches
    if reduction == "mean_with_sample_weight" and sample_weights is not None:
        total = tf.add_n([tf.reduce_sum(w) for w in sample_weights])
        return [tf.math.divide_no_nan(tf.reduce_sum(w), total) for w in sample_weights]
    return [1.0 / num_microbatches] * num_microbatches


class PipelinedModel(keras.Model):
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
        origin=None,
        batch_norm=None,
        virtual_stages=1,
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
        )
        self.built = True

    @property
    def partition(self):
        """Per stage: device, layer names, parameter count and bytes (the chosen split)."""
        return self._plan.partition

    @property
    def stages(self):
        return self._plan.stages

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
        parts = _split_even(inputs, self.num_microbatches)
        outputs = _step.forward_only(self.stages, parts, training=training)
        with tf.device(self.stages[-1].device):
            return tf.concat(outputs, axis=0)

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
        bound = inspect.signature(keras.Model.fit).bind(self, *args, **kwargs)
        self._check_batches(bound.arguments)
        return super().fit(*args, **kwargs)

    def _check_batches(self, arguments):
        """Fails before training when a batch of `fit` cannot be cut into M micro-batches."""
        x, m = arguments.get("x"), self.num_microbatches
        if isinstance(x, tf.data.Dataset):
            first = tf.nest.flatten(x.element_spec)[0]
            sizes = [first.shape[0]] if first.shape.rank else []
        elif hasattr(x, "shape") and len(x.shape):
            n = x.shape[0]
            split = arguments.get("validation_split") or 0.0
            n = math.ceil(n * (1.0 - split)) if split else n
            batch = arguments.get("batch_size") or 32
            sizes = [min(batch, n)] + ([n % batch] if n % batch else [])
        else:
            return
        for size in sizes:
            if size is not None and size % m:
                raise StrategyError(
                    f"Invalid value for argument `num_microbatches`. Received: num_microbatches={m} "
                    f"for a batch of {size} samples. Expected a divisor of every batch size: "
                    "choose batch_size (and the number of samples) as multiples of it."
                )

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        m, stages = self.num_microbatches, self.stages
        batch = self._checked_batch_size(x)
        with tf.device(stages[0].device):
            xs = tf.split(x, m)
        with tf.device(stages[-1].device):
            ys, sws = _split_exact(y, m), _split_exact(sample_weight, m)
            weights = _microbatch_weights(_loss_reduction(self.loss), sws, m)
        loss_object, terms = keras_compile_loss.compiled_loss(self), []

        def loss_fn(i, y_pred):
            value = loss_object(ys[i], y_pred, None if sws is None else sws[i]) * weights[i]
            terms.append(value)
            return self.optimizer.scale_loss(value)

        def run():
            return _step.run_batch(stages, self.schedule, xs, loss_fn, self.virtual_stages)

        deferred = self._plan.batch_norm
        y_preds, _, gradients = deferred.run(run, m) if deferred else run()
        regularization = self._regularization(gradients)
        variables = [v for stage in stages for v in stage.trainable_variables]
        self.optimizer.apply_gradients(zip([g for gs in gradients for g in gs], variables))
        with tf.device(stages[-1].device):
            loss = tf.add_n(terms + regularization)
            y_pred = tf.concat(y_preds, axis=0)
        keras_compile_loss.update_loss_tracker(self, loss, batch)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _checked_batch_size(self, x):
        m, n = self.num_microbatches, x.shape[0]
        if n is not None and n % m:
            raise StrategyError(
                f"Invalid value for argument `num_microbatches`. Received: num_microbatches={m} "
                f"for a batch of {n} samples. Expected a divisor of every batch size."
            )
        batch = tf.shape(x)[0]
        if n is None:
            tf.debugging.assert_equal(
                batch % m, 0, message=f"num_microbatches={m} must divide every batch size"
            )
        return batch

    def _regularization(self, gradients):
        """Adds each stage's weight-regularisation gradient (on its device); returns the losses."""
        losses = []
        for stage in self.stages:
            with tf.device(stage.device), tf.GradientTape() as tape:
                stage_losses = [loss for layer in stage.layers for loss in layer.losses]
                if not stage_losses:
                    continue
                value = tf.add_n(stage_losses)
                scaled = self.optimizer.scale_loss(value)
            grads = tape.gradient(scaled, stage.trainable_variables)
            with tf.device(stage.device):
                gradients[stage.index] = [
                    a if g is None else a + tf.convert_to_tensor(g)
                    for a, g in zip(gradients[stage.index], grads)
                ]
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

    def save_weights(self, filepath, overwrite=True, max_shard_size=None):
        """Writes the unsplit model's weights file (loadable by the user's original model)."""
        return self.unsplit_model.save_weights(filepath, overwrite=overwrite, max_shard_size=max_shard_size)

    def load_weights(self, filepath, skip_mismatch=False, **kwargs):
        """Loads a weights file of the unsplit model (or written by `save_weights`)."""
        return self.unsplit_model.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
