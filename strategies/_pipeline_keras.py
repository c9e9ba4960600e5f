"""The few Keras and TensorFlow internals the pipeline needs, in one place.

Checked on Keras 3.0-3.15 (TF backend) and TensorFlow 2.16-2.21.

Keras 3 has no public hook to compute the compiled loss *without* `model.losses`, nor to
update the "loss" metric the way `Model.train_step` does, nor to choose where an
optimizer's slot variables live. A pipelined `train_step` needs all three:

- `model._compile_loss(y, y_pred, sample_weight)`: the compiled loss of one micro-batch.
  `Model.compute_loss` would add `model.losses` (weight regularisation) once per
  micro-batch and differentiate it on the last stage's device, where the other stages'
  variables do not live.
- `model._loss_tracker`: the `Mean` behind the "loss" log, updated as
  `keras/src/backend/tensorflow/trainer.py::train_step` does.
- `optimizer.add_variable_from_reference`: Keras's TF optimizer asks the distribution
  strategy to colocate slots with their variable, which the default strategy ignores
  (keras-team/keras: slots land on the default device), so momentum and velocity of a
  stage's variables would live on device 0. Wrapping the public method on the instance
  puts each slot on its variable's device.
- `tf.Operation._add_control_input` (TF 1.x-2.21): makes a stage execute its contractions
  (matmuls, convolutions) one at a time (`chain_in_creation_order`). Logical CPU devices
  share one inter-op thread pool, so without it one stage can run two of its ops at once
  on both cores (e.g. a Dense layer's input and weight gradients), which a GPU stream never
  does, and "one core per stage" would not hold. `tf.control_dependencies` cannot express
  it: the ops come from `GradientTape.gradient` all at once.
- `tf.Operation._update_input` / `_set_attr` (TF 1.x-2.21): `pretranspose_matmul_weights`
  rewrites a backward `MatMul(dy, w, transpose_b=True)` into `MatMul(dy, w_t)`. Eigen's
  single-thread MatMul with `transpose_b` is ~55% slower on a micro-batch of 256 rows than
  on a pre-transposed operand (measured, TF 2.21, 256x512 @ 512x512: 21 vs 14 ms for 8
  such products), while at 2048 rows both are alike: without the rewrite every micro-batch
  backward pays it, and M=8 loses ~13% of its speed before any overlap. The gradient
  functions are TensorFlow's (`_MatMulGrad`) and the tape offers no override, hence the
  rewrite of the ops it created.
"""

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

__all__ = [
    "chain_in_creation_order",
    "compiled_loss",
    "place_slots_with_variables",
    "pretranspose_matmul_weights",
    "update_loss_tracker",
    "variable_device",
]

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


def compiled_loss(model):
    """The `CompileLoss` of a compiled model (None if compiled without `loss`)."""
    return getattr(model, "_compile_loss", None)


def update_loss_tracker(model, loss, batch_size):
    """Updates the "loss" metric exactly like Keras's own TF `train_step`."""
    model._loss_tracker.update_state(loss, sample_weight=batch_size)


def variable_device(variable):
    """The device of a Keras variable's backing `tf.Variable`."""
    return getattr(variable, "value", variable).device


def place_slots_with_variables(optimizer):
    """Makes `optimizer` create each slot variable on the device of its model variable."""
    if getattr(optimizer, "_tfscale_placed_slots", False):
        return
    create = optimizer.add_variable_from_reference

    def add_variable_from_reference(reference_variable, *args, **kwargs):
        with tf.device(variable_device(reference_variable)):
            return create(reference_variable, *args, **kwargs)

    optimizer.add_variable_from_reference = add_variable_from_reference
    optimizer._tfscale_placed_slots = True


def chain_in_creation_order(operations):
    """Adds control edges so that the contractions among `operations` run one at a time.

    They run in creation order, a topological order of the graph (an op is created after
    its inputs); every added edge points from an earlier to a later op, so no cycle forms.

    Returns:
        The last contraction (None if there is none).
    """
    previous = None
    for op in operations:
        if op.type not in _CONTRACTIONS:
            continue
        if previous is not None:
            op._add_control_input(previous)
        previous = op
    return previous


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
