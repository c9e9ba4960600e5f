"""`DistributedOptimizer` and `DistributedGradientTape`: gradients averaged over ranks.

Keras 3 optimizers take gradients through `apply(grads, variables)` (`model.fit`,
`apply_gradients` and custom loops all end there), so the distributed optimizer is a
subclass of the user's optimizer class whose `apply` all-reduces the gradients first,
as Horovod's `DistributedOptimizer` subclasses it. With `backward_passes_per_step=k`
each rank sums its gradients locally in optimizer variables (saved and restored with
the optimizer, so a resumed run continues mid-accumulation) and the k-th call
all-reduces the sum once and applies it: `iterations` counts applied updates.
"""

import keras
import tensorflow as tf

from tfscale.horovod import _collective
from tfscale.horovod._errors import HorovodError

__all__ = ["DistributedGradientTape", "DistributedOptimizer"]

_ACCUMULATOR = "hvd_accumulator"


def _check_defaults(**given):
    """Horovod knobs that only tune fusion or placement: only their default is accepted."""
    defaults = {
        "device_dense": "",
        "device_sparse": "",
        "num_groups": 0,
        "groups": None,
        "process_set": None,
        "scale_local_gradients": True,
    }
    for name, value in given.items():
        if value != defaults[name]:
            raise HorovodError(
                f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected "
                f"{defaults[name]!r}: tfscale all-reduces all gradients of a step in one launch."
            )


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HorovodError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected an integer >= 1."
        )
    return value


class _Reducer:
    """All-reduces gradient lists with fixed options; None gradients stay None."""

    def __init__(self, compression, op, sparse_as_dense, gradient_predivide_factor):
        self.op = _collective._check_op(op, None)
        self.compression = _collective._check_compression(compression)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.predivide = _collective._check_scale("gradient_predivide_factor", gradient_predivide_factor)
        if self.predivide != 1.0 and self.op != _collective.Average:
            raise HorovodError(
                "Argument `gradient_predivide_factor` works with op=hvd.Average only. "
                f"Received: gradient_predivide_factor={gradient_predivide_factor!r}, op={op!r}."
            )

    def __call__(self, grads):
        grads = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return grads
        values = [grads[i] for i in present]
        if self.sparse_as_dense:
            values = [tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in values]
        # Horovod's predivide: divide by f before the sum, by size/f after (the same average).
        size = _collective._basics.size()
        reduced = _collective.grouped_allreduce(
            values,
            compression=self.compression,
            op=_collective.Sum,
            prescale_factor=1.0 / self.predivide,
            postscale_factor=(self.predivide / size) if self.op == _collective.Average else 1.0,
            name="gradient",
        )
        out = list(grads)
        for i, r in zip(present, reduced):
            out[i] = r
        return out


class _DistributedMixin:
    """Put before a Keras optimizer class: `apply` all-reduces gradients first."""

    def build(self, variables):
        super().build(variables)
        if self._hvd_passes > 1:
            self._hvd_accumulators = [
                self.add_variable_from_reference(v, name=_ACCUMULATOR) for v in variables
            ]
            for a in self._hvd_accumulators:
                setattr(a, _collective.RANK_LOCAL, True)  # never broadcast: each rank's partial sum
            self._hvd_count = self.add_variable(shape=(), dtype="int64", name="hvd_backward_passes")

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._hvd_passes == 1:
            return super().apply(self._hvd_reduce(grads), trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
        return self._hvd_accumulate(grads, variables)

    def _hvd_accumulate(self, grads, variables):
        accumulators = [self._hvd_accumulators[self._get_variable_index(v)] for v in variables]
        for g, a in zip(grads, accumulators):
            if g is not None:
                a.assign_add(tf.cast(tf.convert_to_tensor(g), a.dtype))
        self._hvd_count.assign_add(1)
        parent = super(_DistributedMixin, self)

        def update():
            scale = 1.0 / self._hvd_passes if self._hvd_average_aggregated else 1.0
            summed = [None if g is None else a.value * scale for g, a in zip(grads, accumulators)]
            parent.apply(self._hvd_reduce(summed), variables)
            for a in accumulators:
                a.assign(tf.zeros(a.shape, a.dtype))

        due = tf.equal(self._hvd_count % self._hvd_passes, 0)
        if tf.executing_eagerly():
            if bool(due):
                update()
        else:
            tf.cond(due, lambda: (update(), tf.constant(True))[1], lambda: tf.constant(False))


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=_collective.Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=_collective.Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=None,
    scale_local_gradients=True,
):
    """A copy of the Keras 3 `optimizer` that averages (or sums) gradients over ranks before applying.

    Args:
        optimizer: a `keras.optimizers.Optimizer` (not built yet: its config is copied).
        name: a name for the new optimizer (default: the original's).
        compression: `hvd.Compression.none` or `hvd.Compression.fp16`.
        sparse_as_dense: all-reduce `IndexedSlices` gradients as dense tensors.
        gradient_predivide_factor: divide by this before the sum and by size/f after.
        op: `hvd.Average` (default) or `hvd.Sum`.
        backward_passes_per_step: apply once every k calls, on the local gradients of
            the k calls summed (and averaged over the k calls with
            `average_aggregated_gradients=True`), all-reduced once.
        average_aggregated_gradients: see `backward_passes_per_step`.
        device_dense, device_sparse, num_groups, groups, process_set,
            scale_local_gradients: Horovod's fusion and placement knobs; only their
            defaults.

    Raises:
        HorovodError: not a Keras 3 optimizer, or an argument tfscale cannot honour.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise HorovodError(
            f"Invalid value for argument `optimizer`. Received: {optimizer!r}. Expected a Keras 3 "
            "optimizer (keras.optimizers.*)."
        )
    if isinstance(optimizer, _DistributedMixin):
        raise HorovodError(
            "The optimizer is already a DistributedOptimizer. Expected a plain Keras optimizer."
        )
    _check_defaults(
        device_dense=device_dense,
        device_sparse=device_sparse,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    passes = _positive_int("backward_passes_per_step", backward_passes_per_step)
    reducer = _Reducer(compression, op, sparse_as_dense, gradient_predivide_factor)
    base = optimizer.__class__
    # Saved under the original class's module and name: `load_model` of a `.keras` file
    # written with it gives the plain Keras optimizer, as it would without Horovod.
    cls = type(
        base.__name__,
        (_DistributedMixin, base),
        {"__module__": base.__module__, "__qualname__": base.__qualname__},
    )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    distributed = cls.from_config(config)
    distributed._hvd_reduce = reducer
    distributed._hvd_passes = passes
    distributed._hvd_average_aggregated = bool(average_aggregated_gradients)
    return distributed


class DistributedGradientTape:
    """Wraps a `tf.GradientTape`: `gradient()` returns the gradients all-reduced over ranks.

    Args:
        gradtape: the `tf.GradientTape` that recorded the loss.
        compression, sparse_as_dense, op, gradient_predivide_factor: as for
            `DistributedOptimizer`.
        device_dense, device_sparse, num_groups, groups, process_set,
            scale_local_gradients: only their defaults.
    """

    def __init__(
        self,
        gradtape,
        device_dense="",
        device_sparse="",
        compression=_collective.Compression.none,
        sparse_as_dense=False,
        op=_collective.Average,
        gradient_predivide_factor=1.0,
        num_groups=0,
        groups=None,
        process_set=None,
        scale_local_gradients=True,
    ):
        if not isinstance(gradtape, tf.GradientTape):
            raise HorovodError(
                f"Invalid value for argument `gradtape`. Received: {gradtape!r}. Expected a tf.GradientTape."
            )
        _check_defaults(
            device_dense=device_dense,
            device_sparse=device_sparse,
            num_groups=num_groups,
            groups=groups,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )
        self._tape = gradtape
        self._reduce = _Reducer(compression, op, sparse_as_dense, gradient_predivide_factor)

    def gradient(
        self, target, sources, output_gradients=None, unconnected_gradients=tf.UnconnectedGradients.NONE
    ):
        """`tf.GradientTape.gradient`, then the gradients all-reduced in one launch."""
        grads = self._tape.gradient(
            target, sources, output_gradients=output_gradients, unconnected_gradients=unconnected_gradients
        )
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, self._reduce(flat))

    def __getattr__(self, name):
        return getattr(self._tape, name)  # watch, stop_recording, reset, ...

    def __enter__(self):
        self._tape.__enter__()
        return self

    def __exit__(self, *exc):
        return self._tape.__exit__(*exc)
