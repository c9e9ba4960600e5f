"""Tensor-split (Megatron-style) Keras layers: each holds K weight shards, one per device.

Pairing (Megatron-LM, Shoeybi et al. 2019): a `ColumnParallelDense` with
`gather_output=False` hands K activation shards (a list) to a `RowParallelDense` with
`input_is_parallel=True`; the only communication is the sum of the K partial outputs
(forward), whose gradient is the copy of the output gradient to every device (backward).
`HeadParallelMultiHeadAttention` is the same pairing inside attention: heads are
column-split (Q, K, V), the output projection row-split. `VocabParallelEmbedding` splits
the table by rows; each device looks up the ids in its range and the results are summed.

Each layer keeps the math and the `get_weights()` order of its Keras counterpart via
`full_weights()` / `set_full_weights()`, so weights move between split and unsplit models.
"""

import collections
import functools

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfscale.compat.keras_mask import get_keras_mask
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._placement import on_device

__all__ = [
    "ColumnParallelDense",
    "HeadParallelMultiHeadAttention",
    "ModelSplitError",
    "RowParallelDense",
    "ShardGroup",
    "VocabParallelEmbedding",
    "is_elementwise",
]


class ModelSplitError(StrategyError):
    """A layer that cannot be split as asked (names the layer, the value and what fits)."""


def _activations(*names):
    # getattr: some of these appeared in later Keras 3 releases.
    return {getattr(keras.activations, n) for n in names if hasattr(keras.activations, n)}


# Activations applied to each number on its own, so applying them to a slice of the units
# gives that slice of the full result. Softmax, log_softmax, glu and any custom callable
# mix the units and are not here: a split layer gathers before applying them.
_ELEMENTWISE = _activations(
    "linear", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "silu", "swish",
    "mish", "tanh", "sigmoid", "hard_sigmoid", "hard_silu", "hard_swish", "hard_tanh",
    "softplus", "softsign", "exponential", "log_sigmoid", "sparse_plus", "squareplus",
    "hard_shrink", "soft_shrink", "tanh_shrink",
)  # fmt: skip


def is_elementwise(activation):
    """Whether `activation` (a name or callable) acts on each unit alone (split-safe)."""
    try:
        return keras.activations.get(activation) in _ELEMENTWISE
    except (TypeError, ValueError):
        return False


class ShardGroup(collections.namedtuple("ShardGroup", ["variables", "axis"])):
    """The K shard variables of one weight of the unsplit layer, cut along `axis`."""

    def gather(self):
        """The unsplit weight's value (numpy)."""
        return _gather(self.variables, self.axis)

    def assign(self, full):
        """Loads the unsplit weight's value `full` into the shards."""
        _set_shards(self.variables, full, self.axis)

    @property
    def shape(self):
        shapes = [tuple(v.shape) for v in self.variables]
        size = sum(shape[self.axis] for shape in shapes)
        return (*shapes[0][: self.axis], size, *shapes[0][self.axis + 1 :])


class _Sharded(keras.layers.Layer):
    """Base: K devices, divisibility checks, shards initialised from the full shape."""

    def __init__(self, devices, **kwargs):
        super().__init__(**kwargs)
        if isinstance(devices, str) or not devices:
            raise ModelSplitError(
                f"Invalid value for argument `devices` of layer {self.name!r}. Received: "
                f"devices={devices!r}. Expected a non-empty list of device names."
            )
        self.devices = [str(d) for d in devices]

    @property
    def num_shards(self):
        return len(self.devices)

    def _check_divisible(self, size, what):
        if size is None or size % self.num_shards:
            raise ModelSplitError(
                f"Cannot split layer {self.name!r} ({type(self).__name__}) {self.num_shards} ways: "
                f"its {what} is {size}, not divisible by {self.num_shards}. Use a number of "
                f"devices that divides {size}, or leave this layer unsplit."
            )
        return size // self.num_shards

    def _add_shards(self, name, full_shape, axis, initializer):
        """One variable per device, each a slice of one full-shape initial value.

        Drawing the full tensor once (then cutting it) gives the split layer the same
        initial distribution as the unsplit layer; it is transient host memory at build.
        """
        full = np.asarray(keras.initializers.get(initializer)(full_shape, dtype=self.variable_dtype))
        pieces = np.split(full, self.num_shards, axis=axis)
        shards = []
        for i, (device, piece) in enumerate(zip(self.devices, pieces)):
            with tf.device(device):
                shards.append(
                    self.add_weight(
                        name=f"{name}_shard_{i}",
                        shape=piece.shape,
                        initializer=functools.partial(_constant, piece),
                    )
                )
        self.shard_groups.append(ShardGroup(tuple(shards), axis))
        return shards

    @property
    def shard_groups(self):
        """One `ShardGroup` per weight of the unsplit layer, in the order it was made."""
        if not hasattr(self, "_shard_groups"):
            # Untracked (a plain Python list of variables would be tracked as weights again).
            object.__setattr__(self, "_shard_groups", [])
        return self._shard_groups

    def get_config(self):
        return {**super().get_config(), "devices": list(self.devices)}


def _activation_name(activation):
    return getattr(activation, "__name__", type(activation).__name__)


def _constant(value, shape=None, dtype=None):
    return ops.convert_to_tensor(value, dtype=dtype)


def _set_shards(shards, full, axis):
    for variable, piece in zip(shards, np.split(np.asarray(full), len(shards), axis=axis)):
        variable.assign(piece)


def _gather(shards, axis):
    return np.concatenate([s.value.numpy() for s in shards], axis=axis)


def _sum(tensors):
    # A fixed left-to-right order, so the result does not depend on thread timing.
    return functools.reduce(ops.add, tensors)


class _DenseLike(_Sharded):
    def __init__(
        self,
        units,
        devices,
        *,
        activation=None,
        use_bias=True,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        **kwargs,
    ):
        super().__init__(devices, **kwargs)
        self.units = int(units)
        self.activation = keras.activations.get(activation)
        self.use_bias = use_bias
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.bias = []
        # As keras.layers.Dense: a timestep mask (Masking, Embedding(mask_zero)) passes through.
        self.supports_masking = True

    def full_weights(self):
        """The weights as the unsplit `keras.layers.Dense` holds them: [kernel, bias]."""
        kernel = _gather(self.kernel, self._kernel_axis)
        return [kernel, _gather(self.bias, 0)] if self.use_bias else [kernel]

    def set_full_weights(self, weights):
        """Loads `keras.layers.Dense.get_weights()` into the shards."""
        _set_shards(self.kernel, weights[0], self._kernel_axis)
        if self.use_bias:
            _set_shards(self.bias, weights[1], 0)

    def compute_output_shape(self, input_shape):
        return (*input_shape[:-1], self.units)

    def get_config(self):
        return {
            **super().get_config(),
            "units": self.units,
            "activation": keras.activations.serialize(self.activation),
            "use_bias": self.use_bias,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
        }


@keras.saving.register_keras_serializable(package="tfscale")
class ColumnParallelDense(_DenseLike):
    """A Dense layer whose output units are split over K devices.

    Device i holds `kernel[:, i*u/K:(i+1)*u/K]` and the matching bias slice, and computes
    those output units. An elementwise activation (relu, gelu, ...) is applied on each
    device; any other (softmax, log_softmax, a custom callable) mixes the units, so it is
    applied once to the gathered output, never per shard.

    Args:
        units: output units of the whole layer (divisible by `len(devices)`).
        devices: one device name per shard, e.g. `["/device:CPU:0", "/device:CPU:1"]`.
        activation, use_bias, kernel_initializer, bias_initializer: as `keras.layers.Dense`.
        gather_output: True returns the full output (the shards concatenated on the calling
            device); False returns the list of K shards for a `RowParallelDense` with
            `input_is_parallel=True` (Megatron's pairing: no gather between the two; needs
            an elementwise activation).
        **kwargs: base `keras.layers.Layer` arguments (`name`, `dtype`, ...).

    Raises:
        ModelSplitError: `units` not divisible by K, or `gather_output=False` with an
            activation that is not elementwise.

    Example:

    >>> devices = ["/device:CPU:0", "/device:CPU:1"]
    >>> up = ColumnParallelDense(64, devices, activation="relu", gather_output=False)
    >>> down = RowParallelDense(16, devices, input_is_parallel=True)
    >>> y = down(up(keras.ops.ones((2, 16))))
    """

    _kernel_axis = 1

    def __init__(self, units, devices, *, gather_output=True, **kwargs):
        super().__init__(units, devices, **kwargs)
        self.gather_output = gather_output
        self._check_divisible(self.units, "`units`")
        self._per_shard_activation = is_elementwise(self.activation)
        if not gather_output and not self._per_shard_activation:
            raise ModelSplitError(
                f"Cannot split layer {self.name!r} column-wise without gathering: its activation "
                f"{_activation_name(self.activation)!r} is not elementwise, so applying it per "
                "shard would be wrong. Expected gather_output=True or an elementwise activation."
            )

    def build(self, input_shape):
        full = (input_shape[-1], self.units)
        self.kernel = self._add_shards("kernel", full, 1, self.kernel_initializer)
        if self.use_bias:
            self.bias = self._add_shards("bias", (self.units,), 0, self.bias_initializer)

    def call(self, inputs):
        shards = [
            on_device(device, functools.partial(self._shard, i), inputs)
            for i, device in enumerate(self.devices)
        ]
        if not self.gather_output:
            return shards
        y = ops.concatenate(shards, axis=-1)
        return y if self._per_shard_activation else self.activation(y)

    def _shard(self, i, x):
        y = ops.matmul(x, self.kernel[i])
        y = ops.add(y, self.bias[i]) if self.use_bias else y
        return self.activation(y) if self._per_shard_activation else y

    def compute_output_shape(self, input_shape):
        if self.gather_output:
            return super().compute_output_shape(input_shape)
        return [(*input_shape[:-1], self.units // self.num_shards)] * self.num_shards

    def get_config(self):
        return {**super().get_config(), "gather_output": self.gather_output}


@keras.saving.register_keras_serializable(package="tfscale")
class RowParallelDense(_DenseLike):
    """A Dense layer whose input features are split over K devices.

    Device i holds `kernel[i*n/K:(i+1)*n/K, :]` and multiplies its slice of the input; the
    K partial outputs are summed on the calling device, then the bias (stored as K slices
    of the output units, one per device) and the activation are applied.

    Args:
        units: output units (divisible by `len(devices)`, for the bias slices).
        devices: one device name per shard.
        activation, use_bias, kernel_initializer, bias_initializer: as `keras.layers.Dense`.
        input_is_parallel: True takes the list of K shards of a `ColumnParallelDense`
            (`gather_output=False`); False takes a full tensor and slices it.
        **kwargs: base `keras.layers.Layer` arguments.
    """

    _kernel_axis = 0

    def __init__(self, units, devices, *, input_is_parallel=False, **kwargs):
        super().__init__(units, devices, **kwargs)
        self.input_is_parallel = input_is_parallel
        self._check_divisible(self.units, "`units` (for the bias slices)")

    def build(self, input_shape):
        if self.input_is_parallel:
            input_dim = sum(shape[-1] for shape in input_shape)
        else:
            input_dim = input_shape[-1]
        self._check_divisible(input_dim, "input dimension")
        self.kernel = self._add_shards("kernel", (input_dim, self.units), 0, self.kernel_initializer)
        if self.use_bias:
            self.bias = self._add_shards("bias", (self.units,), 0, self.bias_initializer)

    def call(self, inputs):
        pieces = inputs if self.input_is_parallel else ops.split(inputs, self.num_shards, axis=-1)
        y = _sum(
            [
                on_device(d, functools.partial(self._shard, i), p)
                for i, (d, p) in enumerate(zip(self.devices, pieces))
            ]
        )
        if self.use_bias:
            y = ops.add(y, ops.concatenate(self.bias, axis=0))
        return self.activation(y)

    def _shard(self, i, x):
        return ops.matmul(x, self.kernel[i])

    def compute_output_shape(self, input_shape):
        if self.input_is_parallel:
            input_shape = input_shape[0]
        return super().compute_output_shape(input_shape)

    def get_config(self):
        return {**super().get_config(), "input_is_parallel": self.input_is_parallel}


@keras.saving.register_keras_serializable(package="tfscale")
class VocabParallelEmbedding(_Sharded):
    """An Embedding whose table rows (the vocabulary) are split over K devices.

    Device i holds rows `[i*V/K, (i+1)*V/K)`, looks up the ids in its range (zeros for the
    others) and the K results are summed: exactly the unsplit lookup, as x + 0 = x.

    Args:
        input_dim: vocabulary size (divisible by `len(devices)`).
        output_dim: embedding size.
        devices: one device name per shard.
        embeddings_initializer, mask_zero: as `keras.layers.Embedding`.
        **kwargs: base `keras.layers.Layer` arguments.
    """

    def __init__(
        self, input_dim, output_dim, devices, embeddings_initializer="uniform", mask_zero=False, **kwargs
    ):
        super().__init__(devices, **kwargs)
        self.input_dim, self.output_dim = int(input_dim), int(output_dim)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.mask_zero = mask_zero
        self.supports_masking = mask_zero
        self._rows = self._check_divisible(self.input_dim, "`input_dim` (vocabulary size)")

    def build(self, input_shape=None):
        full = (self.input_dim, self.output_dim)
        self.embeddings = self._add_shards("embeddings", full, 0, self.embeddings_initializer)

    def call(self, inputs):
        ids = ops.cast(inputs, "int32")
        return _sum(
            [on_device(d, functools.partial(self._shard, i), ids) for i, d in enumerate(self.devices)]
        )

    def _shard(self, i, ids):
        local = ids - i * self._rows
        inside = ops.logical_and(local >= 0, local < self._rows)
        rows = ops.take(self.embeddings[i], ops.where(inside, local, 0), axis=0)
        return rows * ops.cast(ops.expand_dims(inside, -1), rows.dtype)

    def compute_mask(self, inputs, mask=None):
        return ops.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape):
        return (*input_shape, self.output_dim)

    def full_weights(self):
        """The weights as `keras.layers.Embedding` holds them: [embeddings]."""
        return [_gather(self.embeddings, 0)]

    def set_full_weights(self, weights):
        """Loads `keras.layers.Embedding.get_weights()` into the shards."""
        _set_shards(self.embeddings, weights[0], 0)

    def get_config(self):
        return {
            **super().get_config(),
            "input_dim": self.input_dim,
            "output_dim": self.output_dim,
            "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
            "mask_zero": self.mask_zero,
        }


@keras.saving.register_keras_serializable(package="tfscale")
class HeadParallelMultiHeadAttention(_Sharded):
    """Multi-head attention with its heads split over K devices.

    Device i holds the query, key and value projections of heads `[i*N/K, (i+1)*N/K)`
    (column split) and the matching rows of the output projection (row split); it computes
    attention for its heads, and the K partial outputs are summed on the calling device.
    Same math and `get_weights()` order as `keras.layers.MultiHeadAttention` for 3-D inputs
    (batch, sequence, features) and `attention_axes=None`.

    Args:
        num_heads: number of heads (divisible by `len(devices)`).
        key_dim, value_dim, dropout, use_bias, output_shape, kernel_initializer,
            bias_initializer, seed: as `keras.layers.MultiHeadAttention` (`output_shape`
            None or an int; the output features must divide by `len(devices)`).
        devices: one device name per shard.
        **kwargs: base `keras.layers.Layer` arguments.

    Call arguments: `query`, `value`, `key=None`, `attention_mask=None`,
    `use_causal_mask=False`, `training=None`, and the Keras masks of the inputs, as in
    `keras.layers.MultiHeadAttention` (no `return_attention_scores`).
    """

    def __init__(
        self,
        num_heads,
        key_dim,
        devices,
        *,
        value_dim=None,
        dropout=0.0,
        use_bias=True,
        output_shape=None,
        kernel_initializer="glorot_uniform",
        bias_initializer="zeros",
        seed=None,
        **kwargs,
    ):
        super().__init__(devices, **kwargs)
        self.num_heads, self.key_dim = int(num_heads), int(key_dim)
        self.value_dim = int(value_dim or key_dim)
        self.dropout, self.use_bias, self.output_shape, self.seed = dropout, use_bias, output_shape, seed
        self.kernel_initializer = keras.initializers.get(kernel_initializer)
        self.bias_initializer = keras.initializers.get(bias_initializer)
        self.supports_masking = True
        self._heads = self._check_divisible(self.num_heads, "`num_heads`")
        self._softmax = keras.layers.Softmax(axis=-1, dtype=self.dtype_policy)
        self._dropout_layer = keras.layers.Dropout(dropout, seed=seed, dtype=self.dtype_policy)

    def build(self, query_shape, value_shape, key_shape=None):
        key_shape = value_shape if key_shape is None else key_shape
        out = self.output_shape or query_shape[-1]
        self._check_divisible(out, "output features")
        heads, kd, vd = self.num_heads, self.key_dim, self.value_dim
        self._proj = {}
        projections = [
            ("query", query_shape[-1], kd),
            ("key", key_shape[-1], kd),
            ("value", value_shape[-1], vd),
        ]
        for name, dim, size in projections:
            kernel = self._add_shards(f"{name}_kernel", (dim, heads, size), 1, self.kernel_initializer)
            bias = (
                self._add_shards(f"{name}_bias", (heads, size), 0, self.bias_initializer)
                if self.use_bias
                else []
            )
            self._proj[name] = (kernel, bias)
        self.output_kernel = self._add_shards("output_kernel", (heads, vd, out), 0, self.kernel_initializer)
        self.output_bias = (
            self._add_shards("output_bias", (out,), 0, self.bias_initializer) if self.use_bias else []
        )

    def _project(self, name, x, i):
        kernel, bias = self._proj[name]
        y = ops.einsum("abc,cde->abde", x, kernel[i])
        return ops.add(y, bias[i]) if self.use_bias else y

    def call(self, query, value, key=None, *, attention_mask=None, use_causal_mask=False, training=None):
        key_given = key is not None
        key = value if key is None else key
        mask = self._attention_mask(query, value, key if key_given else None, attention_mask, use_causal_mask)
        inputs = (query, key, value) if mask is None else (query, key, value, mask)
        shard = functools.partial(self._shard, training)
        y = _sum([on_device(d, functools.partial(shard, i), *inputs) for i, d in enumerate(self.devices)])
        return ops.add(y, ops.concatenate(self.output_bias, axis=0)) if self.use_bias else y

    def _shard(self, training, i, *tensors):
        query, key, value, mask = (*tensors, None) if len(tensors) == 3 else tensors
        q, k, v = (
            self._project(name, x, i) for name, x in zip(("query", "key", "value"), (query, key, value))
        )
        return ops.einsum("abcd,cde->abe", self._attend(q, k, v, mask, training), self.output_kernel[i])

    def _attend(self, q, k, v, mask, training):
        scale = 1.0 / float(np.sqrt(self.key_dim))
        if not self.dropout:
            # The path keras.layers.MultiHeadAttention takes without dropout (same kernel).
            mask4 = None if mask is None else ops.expand_dims(mask, axis=-3)
            return ops.dot_product_attention(q, k, v, mask=mask4, scale=scale)
        q = ops.multiply(q, ops.cast(scale, q.dtype))
        scores = ops.einsum("aecd,abcd->acbe", k, q)
        mask4 = None if mask is None else ops.expand_dims(mask, axis=-3)
        probs = self._dropout_layer(self._softmax(scores, mask=mask4), training=training)
        return ops.einsum("acbe,aecd->abcd", probs, v)

    def _attention_mask(self, query, value, key, attention_mask, use_causal_mask):
        """The (B, T, S) boolean mask, combined as keras.layers.MultiHeadAttention does."""
        masks = []
        for x, axis in ((query, -1), (value, -2), (key, -2)):
            found = None if x is None else get_keras_mask(x)
            if found is not None:
                masks.append(ops.expand_dims(ops.cast(found, "bool"), axis))
        if use_causal_mask:
            ones = ops.ones((1, ops.shape(query)[1], ops.shape(value)[1]), dtype="int32")
            masks.append(ops.greater_equal(ops.cumsum(ones, axis=-2), ops.cumsum(ones, axis=-1)))
        if attention_mask is not None:
            masks.append(ops.cast(attention_mask, "bool"))
        return functools.reduce(ops.logical_and, masks) if masks else None

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return (*query_shape[:-1], self.output_shape or query_shape[-1])

    def full_weights(self):
        """The weights in `keras.layers.MultiHeadAttention.get_weights()` order."""
        weights = []
        for name in ("query", "key", "value"):
            kernel, bias = self._proj[name]
            weights += [_gather(kernel, 1)] + ([_gather(bias, 0)] if self.use_bias else [])
        weights.append(_gather(self.output_kernel, 0))
        return weights + ([_gather(self.output_bias, 0)] if self.use_bias else [])

    def set_full_weights(self, weights):
        """Loads `keras.layers.MultiHeadAttention.get_weights()` into the shards."""
        weights = list(weights)
        for name in ("query", "key", "value"):
            kernel, bias = self._proj[name]
            _set_shards(kernel, weights.pop(0), 1)
            if self.use_bias:
                _set_shards(bias, weights.pop(0), 0)
        _set_shards(self.output_kernel, weights.pop(0), 0)
        if self.use_bias:
            _set_shards(self.output_bias, weights.pop(0), 0)

    def get_config(self):
        return {
            **super().get_config(),
            "num_heads": self.num_heads,
            "key_dim": self.key_dim,
            "value_dim": self.value_dim,
            "dropout": self.dropout,
            "use_bias": self.use_bias,
            "output_shape": self.output_shape,
            "kernel_initializer": keras.initializers.serialize(self.kernel_initializer),
            "bias_initializer": keras.initializers.serialize(self.bias_initializer),
            "seed": self.seed,
        }
