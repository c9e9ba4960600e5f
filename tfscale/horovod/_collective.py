"""Horovod's collectives: allreduce, grouped_allreduce, allgather, broadcast.

Every call is a collective: all ranks make it, in the same order. Before the data
moves, the ranks exchange each tensor's dtype and shape (a fixed-size all-reduce that
cannot itself mismatch) and fail together with one line naming the ranks and shapes
that disagree, instead of hanging or failing deep in TensorFlow. Eagerly that check
runs at each call; inside a `tf.function` it runs once, eagerly, when the function is
traced (every rank traces the same function at the same point), on the static shapes.
"""

import pickle

import numpy as np
import tensorflow as tf

from tfscale.horovod import _basics
from tfscale.horovod._errors import HorovodError

__all__ = [
    "Average",
    "Compression",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "grouped_allreduce",
]

Average = "Average"
Sum = "Sum"
_OPS = (Average, Sum)
RANK_LOCAL = "_tfscale_rank_local"  # set on variables that differ by rank on purpose
_MAX_DIMS = 6  # dims exchanged per tensor; deeper tensors add their remaining element count
_FIELDS = 2 + _MAX_DIMS + 1


class _NoneCompressor:
    """Sends tensors as they are."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _FP16Compressor:
    """Sends floating-point tensors as float16 (half the bytes of float32) and casts them back."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating and tensor.dtype != tf.float16:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None else tf.cast(tensor, ctx)


class Compression:
    """Horovod's compression choices: `Compression.none` and `Compression.fp16`."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


def _check_op(op, average):
    if average is not None:
        if op is not None:
            raise HorovodError("Arguments `average` and `op` exclude each other. Expected only `op`.")
        return Average if average else Sum
    if op is None:
        return Average
    if op not in _OPS:
        raise HorovodError(
            f"Invalid value for argument `op`. Received: op={op!r}. Expected hvd.Average or hvd.Sum "
            "(Adasum, Min, Max and Product have no tfscale equivalent)."
        )
    return op


def _check_compression(compression):
    if compression not in (Compression.none, Compression.fp16):
        raise HorovodError(
            f"Invalid value for argument `compression`. Received: compression={compression!r}. "
            "Expected hvd.Compression.none or hvd.Compression.fp16."
        )
    return compression


def _describe(dtype_enum, dims):
    dtype = tf.dtypes.as_dtype(int(dtype_enum)).name if dtype_enum > 0 else "?"
    return f"{dtype}[{','.join('?' if d < 0 else str(d) for d in dims)}]"


def _signature(tensor, skip_first):
    """[dtype, rank, dims..., rest]: -1 for an unknown (or, for allgather, free) dimension."""
    dims = tensor.shape.as_list() if tensor.shape.rank is not None else []
    rank = -1 if tensor.shape.rank is None else len(dims)
    dims = [-1 if d is None else d for d in dims]
    if skip_first and dims:
        dims[0] = -1
    head, rest = dims[:_MAX_DIMS], dims[_MAX_DIMS:]
    tail = int(np.prod(rest)) if rest and min(rest) >= 0 else (-1 if rest else 0)
    return [tensor.dtype.as_datatype_enum, rank] + head + [-2] * (_MAX_DIMS - len(head)) + [tail]


def _agree(a, b):
    return all(x == y or -1 in (x, y) for x, y in zip(a, b))


def _unpack(row):
    dtype, rank = int(row[0]), int(row[1])
    return dtype, [int(d) for d in row[2 : 2 + min(max(rank, 0), _MAX_DIMS)]]


def _raise_on_mismatch(table, names, what):
    """`table` [size, n, fields]: every rank's signatures; raises naming the first disagreement."""
    for i, name in enumerate(names):
        rows = table[:, i, :]
        for r in range(1, rows.shape[0]):
            if not _agree(rows[0], rows[r]):
                first, other = _describe(*_unpack(rows[0])), _describe(*_unpack(rows[r]))
                raise HorovodError(
                    f"{what}: ranks disagree on tensor {name!r}: rank 0 has {first}, rank {r} has "
                    f"{other}. Expected the same dtype and shape on every rank."
                )


def _exchange_signatures(tensors, names, what, skip_first=False):
    identity = _basics.current()
    mine = np.array([_signature(t, skip_first) for t in tensors], np.int64)
    table = np.zeros((identity.size, *mine.shape), np.int64)
    table[identity.rank] = mine
    with tf.init_scope():  # eager even while a tf.function is traced: static shapes only
        (summed,) = _basics._State.collectives.all_reduce_sum([tf.constant(table)])
        _raise_on_mismatch(summed.numpy(), names, what)


def _names(tensors, name):
    if name is not None:
        return [name] if len(tensors) == 1 else [f"{name}[{i}]" for i in range(len(tensors))]
    return [getattr(t, "name", None) or f"#{i}" for i, t in enumerate(tensors)]


def _to_tensor(value):
    if isinstance(value, tf.IndexedSlices):
        return value
    return tf.convert_to_tensor(value)


def _check_scale(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HorovodError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected a number."
        )
    return float(value)


def grouped_allreduce(
    tensors,
    average=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
):
    """All-reduces a list of tensors in one launch; returns the reduced list.

    Args:
        tensors: tensors (or variables) of the same dtypes and shapes on every rank.
            `tf.IndexedSlices` are all-gathered (values and indices), as Horovod does.
        average: deprecated Horovod spelling: True is `op=Average`, False `op=Sum`.
        compression: `Compression.none` or `Compression.fp16` (floating tensors travel
            as float16 and come back in their own dtype).
        op: `Average` (default) or `Sum`.
        prescale_factor: multiplies each tensor before the reduction.
        postscale_factor: multiplies each result after it.
        name: a name for error messages.

    Raises:
        HorovodError: a bad argument, or ranks whose tensors differ in dtype or shape.
    """
    op = _check_op(op, average)
    compression = _check_compression(compression)
    pre, post = (
        _check_scale("prescale_factor", prescale_factor),
        _check_scale("postscale_factor", postscale_factor),
    )
    tensors = [_to_tensor(t) for t in tensors]
    identity = _basics.current()
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    results = list(tensors)
    if identity.size > 1 and dense:
        _exchange_signatures(
            [tensors[i] for i in dense], _names([tensors[i] for i in dense], name), "allreduce"
        )
    scale = post / (identity.size if op == Average else 1)
    wire, contexts = [], []
    for i in dense:
        t = tensors[i] * tf.cast(pre, tensors[i].dtype) if pre != 1.0 else tensors[i]
        compressed, ctx = compression.compress(t)
        wire.append(compressed)
        contexts.append(ctx)
    reduced = _basics._State.collectives.all_reduce_sum(wire) if identity.size > 1 and wire else wire
    for i, r, ctx in zip(dense, reduced, contexts):
        value = compression.decompress(r, ctx)
        results[i] = value * tf.cast(scale, value.dtype) if scale != 1.0 else value
    for i, t in enumerate(tensors):
        if isinstance(t, tf.IndexedSlices):
            values = allgather(t.values) * tf.cast(pre * scale, t.values.dtype)
            results[i] = tf.IndexedSlices(values, allgather(t.indices), t.dense_shape)
    return results


def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=None,
    ignore_name_scope=False,
):
    """All-reduces one tensor over every rank (Average by default); see `grouped_allreduce`.

    `device_dense` and `device_sparse` are Horovod's placement hints: only "" (the
    collective runs where TensorFlow's multi-worker collectives run). `process_set`: only
    None (every rank). `ignore_name_scope` changes nothing: tfscale's collectives carry no
    Horovod op names. `horovod.tensorflow.keras`'s spelling `allreduce(value, name)` works
    too: a string second argument is the name.
    """
    if isinstance(average, str):  # horovod.tensorflow.keras: allreduce(value, name=None, ...)
        name, average = average, None
    if process_set is not None:
        raise HorovodError(
            f"Invalid value for argument `process_set`. Received: process_set={process_set!r}. "
            "Expected None: tfscale.horovod has one process set, every rank."
        )
    for arg, value in (("device_dense", device_dense), ("device_sparse", device_sparse)):
        if value:
            raise HorovodError(
                f"Invalid value for argument `{arg}`. Received: {arg}={value!r}. Expected '' "
                "(tfscale places the collective itself)."
            )
    return grouped_allreduce(
        [tensor],
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    )[0]


def allgather(tensor, name=None):
    """Every rank's `tensor` concatenated along axis 0, in rank order (first dims may differ)."""
    tensor = tf.convert_to_tensor(tensor)
    identity = _basics.current()
    if identity.size == 1:
        return tensor
    if tensor.shape.rank == 0:
        raise HorovodError(
            f"allgather: tensor {name or 'tensor'!r} is a scalar. Expected at least one dimension."
        )
    _exchange_signatures([tensor], _names([tensor], name), "allgather", skip_first=True)
    return _basics._State.collectives.all_gather(tensor)


def _check_root(root_rank):
    size = _basics.size()
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or not 0 <= root_rank < size:
        raise HorovodError(
            f"Invalid value for argument `root_rank`. Received: root_rank={root_rank!r}. "
            f"Expected a rank from 0 to {size - 1}."
        )
    return root_rank


def _broadcast_many(tensors, root_rank, names):
    root_rank = _check_root(root_rank)
    identity = _basics.current()
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if identity.size == 1 or not tensors:
        return tensors
    _exchange_signatures(tensors, names, "broadcast")
    # A sum in which only the root contributes: the root's values, bit for bit.
    is_root = identity.rank == root_rank
    wire = [tf.cast(t, tf.int32) if t.dtype == tf.bool else t for t in tensors]
    wire = [t if is_root else tf.zeros_like(t) for t in wire]
    summed = _basics._State.collectives.all_reduce_sum(wire)
    return [tf.cast(s, t.dtype) if t.dtype == tf.bool else s for s, t in zip(summed, tensors)]


def broadcast(tensor, root_rank, name=None):
    """`tensor` of rank `root_rank`, on every rank."""
    return _broadcast_many([tensor], root_rank, [name or "tensor"])[0]


def broadcast_variables(variables, root_rank):
    """Assigns every variable the value it has on rank `root_rank` (one launch for all).

    A DistributedOptimizer's gradient accumulators (`backward_passes_per_step`) hold
    each rank's own partial sums and are left as they are.
    """
    variables = [v for v in variables if not getattr(v, RANK_LOCAL, False)]
    names = [getattr(v, "path", None) or getattr(v, "name", None) or f"#{i}" for i, v in enumerate(variables)]
    values = _broadcast_many(variables, root_rank, names)
    for variable, value in zip(variables, values):
        variable.assign(value)


def broadcast_object(obj, root_rank=0, name=None):
    """A picklable object of rank `root_rank`, on every rank (eager only)."""
    root_rank = _check_root(root_rank)
    if _basics.size() == 1:
        return obj
    data = (
        np.frombuffer(pickle.dumps(obj), np.uint8) if _basics.rank() == root_rank else np.zeros(0, np.uint8)
    )
    length = int(broadcast(tf.constant([len(data)], tf.int64), root_rank, name).numpy()[0])
    padded = np.zeros(length, np.int32)
    padded[: len(data)] = data
    received = broadcast(tf.constant(padded), root_rank, name).numpy().astype(np.uint8)
    return pickle.loads(received.tobytes())
