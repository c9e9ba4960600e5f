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
"""

import tensorflow as tf

__all__ = [
    "chain_in_creation_order",
    "compiled_loss",
    "place_slots_with_variables",
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
