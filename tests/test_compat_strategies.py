"""tfscale.compat shims used by the strategies: each test fails when upstream changes under it.

A test named `test_upstream_...` checks that the gap is still there (when it fails, upstream
fixed it: gate the shim off from that version); the others check the shim still works.
"""

import shutil
import tempfile
from unittest import mock

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfscale.compat import keras_compile_loss, keras_mask, keras_optimizer_slots, tf_graph_edit, tf_xplane


def _slot_devices(place):
    with tf.device("/device:CPU:1"):
        variable = keras.Variable(np.ones((3,), "float32"), name="w")
    optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
    if place:
        keras_optimizer_slots.place_slots_with_variables(optimizer)
    # As in `fit`: the optimizer builds its slots in the first traced step.
    tf.function(lambda: optimizer.apply_gradients([(tf.ones((3,)), variable)]))()
    slots = [v for v in optimizer.variables if v.name not in ("iteration", "learning_rate")]
    return [tf.DeviceSpec.from_string(v.value.device).device_index for v in slots]


def test_upstream_keras_creates_slots_on_the_default_device():
    assert _slot_devices(place=False) == [0]


def test_placed_slots_live_with_their_variable():
    assert _slot_devices(place=True) == [1]


def test_slot_placement_is_version_gated():
    assert keras_optimizer_slots.needed("3.15.1")
    with mock.patch.object(keras_optimizer_slots, "_FIXED_IN", "3.16.0"):
        assert keras_optimizer_slots.needed("3.15.1")
        assert not keras_optimizer_slots.needed("3.16.0")
    with mock.patch.object(keras_optimizer_slots, "needed", return_value=False):
        optimizer = keras.optimizers.SGD()
        before = optimizer.add_variable_from_reference
        keras_optimizer_slots.place_slots_with_variables(optimizer)
        assert optimizer.add_variable_from_reference == before  # A no-op where fixed.


def test_compiled_loss_leaves_out_model_losses_and_tracker_is_the_loss_log():
    model = keras.Sequential(
        [keras.Input((2,)), keras.layers.Dense(1, kernel_regularizer=keras.regularizers.L2(10.0))]
    )
    model.compile(optimizer="sgd", loss="mse")
    assert keras_compile_loss.available(model)
    x, y = np.ones((4, 2), "float32"), np.zeros((4, 1), "float32")
    y_pred = model(x)
    mse = float(keras.losses.mean_squared_error(y, y_pred).numpy().mean())
    assert float(keras_compile_loss.compiled_loss(model)(y, y_pred)) == pytest.approx(mse, rel=1e-6)
    assert float(model.compute_loss(x, y, y_pred)) > mse  # Keras's public one adds model.losses.
    keras_compile_loss.update_loss_tracker(model, 2.5, 4)
    assert {m.name: float(m.result()) for m in model.metrics}["loss"] == pytest.approx(2.5)


def test_keras_mask_reads_the_mask_embedding_attaches():
    ids = np.array([[3, 0, 1, 0]], "int32")
    out = keras.layers.Embedding(5, 2, mask_zero=True)(ids)
    np.testing.assert_array_equal(keras_mask.get_keras_mask(out), ids != 0)
    copy = tf.identity(out)  # a new tensor (as a device hop makes) carries no mask ...
    assert keras_mask.get_keras_mask(copy) is None
    keras_mask.set_keras_mask(copy, ids != 0)  # ... until it is given one
    np.testing.assert_array_equal(keras_mask.get_keras_mask(copy), ids != 0)


def test_keras_mask_set_is_what_keras_losses_read():
    # Keras's loss reads the mask from y_pred: with it set, the padded step is left out.
    y_pred = tf.constant([[[1.0], [5.0]]])
    keras_mask.set_keras_mask(y_pred, tf.constant([[True, False]]))
    assert keras_mask.get_keras_mask(y_pred) is not None
    assert float(keras.losses.MeanSquaredError()(tf.zeros((1, 2, 1)), y_pred)) == 1.0


def _graph_of(fn, *specs):
    return tf.function(fn).get_concrete_function(*specs).graph


def test_chain_in_creation_order_adds_control_edges_between_contractions():
    assert tf_graph_edit.available()
    spec = tf.TensorSpec((2, 2), tf.float32)

    def two_products(a, b):
        return tf.matmul(a, a), tf.matmul(b, b)

    graph = _graph_of(two_products, spec, spec)
    products = [op for op in graph.get_operations() if op.type == "MatMul"]
    assert not products[1].control_inputs
    last = tf_graph_edit.chain_in_creation_order(graph.get_operations())
    assert last is products[1] and products[1].control_inputs == [products[0]]


def test_chain_adds_no_edge_where_the_data_already_orders_two_contractions():
    """A layer's MatMul with a control fan-in is left unfused by grappler (MatMul+BiasAdd+tanh
    in plain Keras's graph is one kernel); float16 rounds the two differently."""
    spec = tf.TensorSpec((2, 2), tf.float32)

    def layers_then_a_branch(a, b):
        hidden = tf.tanh(tf.nn.bias_add(tf.matmul(a, b), [1.0, 2.0]))
        return tf.matmul(hidden, b), tf.matmul(b, b)  # the first reads `hidden`; the second not

    graph = _graph_of(layers_then_a_branch, spec, spec)
    _, second, branch = [op for op in graph.get_operations() if op.type == "MatMul"]
    last = tf_graph_edit.chain_in_creation_order(graph.get_operations())
    assert last is branch
    assert second.control_inputs == [] and branch.control_inputs == [second]


def test_pretranspose_rewrites_transpose_b_and_keeps_the_product():
    a = np.arange(6, dtype="float32").reshape(3, 2)
    w = np.array([[1.0, 2.0], [3.0, 5.0]], "float32")

    @tf.function
    def product(a, w):
        graph = tf.compat.v1.get_default_graph()
        first = len(graph.get_operations())
        y = tf.matmul(a, w, transpose_b=True)
        tf_graph_edit.pretranspose_matmul_weights(graph.get_operations()[first:], {})
        return y

    graph = product.get_concrete_function(tf.TensorSpec((3, 2)), tf.TensorSpec((2, 2))).graph
    matmuls = [op for op in graph.get_operations() if op.type == "MatMul"]
    assert [op.get_attr("transpose_b") for op in matmuls] == [False]
    np.testing.assert_allclose(product(a, w), a @ w.T)


def test_xplane_reader_finds_a_profiled_op_by_name():
    assert tf_xplane.available()

    @tf.function
    def named(x):
        with tf.name_scope("tfscale_probe"):
            return tf.matmul(x, x)

    x = tf.ones((8, 8))
    named(x)
    logdir = tempfile.mkdtemp()
    try:
        tf.profiler.experimental.start(logdir)
        named(x)
        tf.profiler.experimental.stop()
        events = [(n, a, b) for n, a, b in tf_xplane.op_events(logdir) if "tfscale_probe" in n]
    finally:
        shutil.rmtree(logdir)
    assert events and all(b >= a for _, a, b in events)
