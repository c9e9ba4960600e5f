"""Editing ops after `GradientTape.gradient` created them: control edges, a MatMul operand.

Upstream gap: a pipeline stage's backward ops come from `GradientTape.gradient` all at
once, and neither the tape nor `tf.control_dependencies` lets the caller order them or
choose their gradient functions. Two graph edits on the created ops, through private
`tf.Operation` methods (the ones TensorFlow's own graph rewriting uses):

- `Operation._add_control_input` (`chain_in_creation_order`): a stage executes its
  contractions (matmuls, convolutions) one at a time. Logical CPU devices share one
  inter-op thread pool, so without it one stage can run two of its ops at once on both
  cores (e.g. a Dense layer's input and weight gradients), which a GPU stream never does,
  and "one core per stage" would not hold.
- `Operation._update_input` / `_set_attr` (`pretranspose_matmul_weights`): a backward
  `MatMul(dy, w, transpose_b=True)` becomes `MatMul(dy, w_t)`. Eigen's single-thread CPU
  MatMul with `transpose_b` is much slower on a micro-batch of 256 rows than on a
  pre-transposed operand (TF 2.21, 256x512 @ 512x512: 21 vs 14 ms for 8 products), while
  at 2048 rows both are alike. The gradient function is TensorFlow's (`_MatMulGrad`) and
  the tape offers no override, hence the rewrite. CPU only: GPU kernels (cuBLAS) take the
  transposed operand at no cost, so the pipeline applies it to CPU stages only.

Checked on TensorFlow 2.21 (the methods exist in TF 1.x-2.21).
Gate: `available()`; `tests/test_compat_strategies.py` fails when an edit no longer shows
in the graph or changes the result.
"""

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

__all__ = ["available", "chain_in_creation_order", "pretranspose_matmul_weights"]

# The contractions hold nearly all of a stage's compute. Only they are chained: a control
# edge on an elementwise op would stop Grappler from fusing it into its contraction
# (`_FusedMatMul`), which costs more than the rare overlap of two small ops.
_CONTRACTIONS = frozenset(
    [
        "MatMul",
        "BatchMatMul",
        "BatchMatMulV2",
        "BatchMatMulV3",
        "Einsum",
        "Conv2D",
        "Conv2DBackpropInput",
        "Conv2DBackpropFilter",
        "Conv3D",
        "Conv3DBackpropInputV2",
        "Conv3DBackpropFilterV2",
        "DepthwiseConv2dNative",
        "DepthwiseConv2dNativeBackpropInput",
        "DepthwiseConv2dNativeBackpropFilter",
    ]
)


def available():
    """True when `tf.Operation` has the private methods these edits call."""
    return all(hasattr(tf.Operation, m) for m in ("_add_control_input", "_update_input", "_set_attr"))


def chain_in_creation_order(operations):
    """Adds control edges so that the contractions among `operations` run one at a time,
    where their data does not already order them (`_depends_on`).

    They run in creation order, a topological order of the graph (an op is created after
    its inputs); every added edge points from an earlier to a later op, so no cycle forms.

    Returns:
        The last contraction (None if there is none).
    """
    index = {op: i for i, op in enumerate(operations)}
    previous = None
    for op in operations:
        if op.type not in _CONTRACTIONS:
            continue
        if previous is not None and not _depends_on(op, previous, index):
            op._add_control_input(previous)
        previous = op
    return previous


def _depends_on(op, earlier, index):
    """True when `op` reads `earlier`'s result through ops among `index` (made after it).

    Such a pair needs no control edge: the data already orders it (the layers of a forward
    pass). An edge there also cost a fusion: with it, grappler's remapper left a stage's
    MatMul+BiasAdd+activation unfused where plain Keras's graph runs one `_FusedMatMul`
    (TF 2.21, seen with `TF_CPP_VMODULE=remapper=2`), and under float16 a fused and an
    unfused layer round differently (Adam + mixed_float16 ended 0.03 off;
    `REGRESSIONS` in tests/test_equivalence.py).
    """
    floor, seen, stack = index[earlier], set(), [op]
    while stack:
        node = stack.pop()
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            if parent is earlier:
                return True
            if parent not in seen and index.get(parent, -1) > floor:
                seen.add(parent)
                stack.append(parent)
    return False


def _transposed(tensor, cache):
    """`tensor`'s transpose, made once per variable (or tensor) and shared by micro-batches."""
    source = tensor.op.inputs[0] if tensor.op.type == "ReadVariableOp" else tensor
    key = source.ref()
    if key not in cache:
        with tf.device(tensor.device):
            # Grappler folds a bare Transpose back into `transpose_b` (arithmetic optimizer's
            # FoldTransposeIntoMatMul); a Snapshot between them keeps it a real copy.
            cache[key] = tf.raw_ops.Snapshot(input=tf.transpose(tensor))
    return cache[key]


def pretranspose_matmul_weights(operations, cache):
    """Rewrites each `MatMul(a, w, transpose_b=True)` among `operations` as `MatMul(a, w_t)`.

    Only square `w` (e.g. a Dense layer with as many units as inputs): an op's input can be
    swapped in place only for a tensor of the same shape, and replacing the op instead would
    reorder the contractions `chain_in_creation_order` chains.

    The product is the same sum in the same order (float32 alike to round-off); `w_t` is
    computed once per weight for all micro-batches through `cache`, a dict the caller keeps
    for one batch.

    Args:
        operations: the ops of one backward, e.g. those `GradientTape.gradient` created.
        cache: dict from a variable handle (or tensor) reference to its transpose.
    """
    for op in operations:
        if op.type != "MatMul" or not op.get_attr("transpose_b") or op.get_attr("transpose_a"):
            continue
        shape = op.inputs[1].shape
        if shape.rank != 2 or shape[0] is None or shape[0] != shape[1]:
            continue  # `_update_input` keeps the edge's shape: square weights only.
        op._update_input(1, _transposed(op.inputs[1], cache))
        op._set_attr("transpose_b", attr_value_pb2.AttrValue(b=False))
