"""Keras gap: `keras.ops.add` on TensorFlow adds a (batch, 1) tensor as a per-channel bias.

Keras 3's TensorFlow `add` (`keras/src/backend/tensorflow/numpy.py`, since keras-team/keras
#20386, so that grappler fuses MatMul/Conv + BiasAdd) takes `tf.nn.bias_add` whenever its
second argument squeezes to one dimension whose size is the first argument's last (or
second) dimension. It does not check WHERE that dimension is. A per-row term of shape
(batch, 1) added to a (batch, C) activation squeezes to (batch,), and when the batch has C
rows it is added along the channels instead of along the rows: silently wrong numbers,
plain Keras on one device included. Seen in a functional model with
`h + keras.ops.mean(x, axis=-1, keepdims=True)` and Dense(16): batches of 8, 24 and 32 rows
are right, a batch of 16 is off by up to 1.4 (Keras 3.15.1, TensorFlow 2.21). The `Add`
merge layer goes through the same function.

It matters more under tfscale than in plain Keras: a pipeline's micro-batch, a data-parallel
copy's slice and a replica's share have fewer rows than the user's batch, so a model that is
right at the user's batch size can meet the one bad size in a split mode only.

`add_by_broadcasting()` wraps that function: where Keras would take the bias path but the
second argument's non-1 dimension is not at the channel axis of the data format Keras
picked (after aligning the shapes from the right, as broadcasting does), it adds with
`tf.add`, which broadcasts; every other call goes to Keras's own function unchanged (a real
bias, of shape (C,), (1, C) or (C, 1, 1) for NCHW, still takes `bias_add` and its fusion, and
shapes that do not broadcast keep Keras's behaviour).

Checked on Keras 3.15.1 with TensorFlow 2.21.0 only.
Gate: `keras.src.backend.tensorflow.numpy.add` exists; otherwise nothing is changed.
FIXED_IN: none as of Keras 3.15.
"""

import functools
import threading

__all__ = ["CHECKED_ON", "FIXED_IN", "add_by_broadcasting", "misread_as_bias"]

CHECKED_ON = ("3.15.1", "2.21.0")
FIXED_IN = None
_MARK = "_tfscale_broadcasting"
_lock = threading.Lock()


def add_by_broadcasting():
    """Wraps Keras's TensorFlow `add` as above. True if in effect, False where the gate fails."""
    try:
        from keras.src.backend.tensorflow import numpy as tf_numpy
    except ImportError:
        return False
    if not callable(getattr(tf_numpy, "add", None)):
        return False
    with _lock:
        if not getattr(tf_numpy.add, _MARK, False):
            tf_numpy.add = _broadcasting(tf_numpy.add)
    return True


def misread_as_bias(x1_shape, x2_shape):
    """Whether Keras's `add` would add `x2` as a bias where broadcasting means something else.

    Args:
        x1_shape, x2_shape: the static shapes (lists; None for an unknown dimension).
    """
    squeezed = [(k, d) for k, d in enumerate(x2_shape) if d is None or d > 1]
    if len(squeezed) != 1 or len(x1_shape) < 2 or squeezed[0][1] is None:
        return False  # Keras's own test for its bias path fails: it adds with tf.add
    k, size = squeezed[0]
    if size not in {x1_shape[1], x1_shape[-1]}:
        return False
    channel = len(x1_shape) - 1 if x1_shape[-1] == size else 1  # NHWC, else NCHW (Keras's choice)
    # Broadcasting aligns the shapes from the right: x2's dimension k meets x1's `position`.
    position = len(x1_shape) - len(x2_shape) + k
    # Only where broadcasting has a meaning and Keras's differs (shapes that do not broadcast
    # keep Keras's behaviour).
    return _broadcast(x1_shape, x2_shape) and position != channel


def _broadcast(a, b):
    """Whether numpy would broadcast shapes `a` and `b` (an unknown dimension fits any)."""
    for m, n in zip(reversed(a), reversed(b)):
        if m is not None and n is not None and m != n and 1 not in (m, n):
            return False
    return True


def _broadcasting(original):
    @functools.wraps(original)
    def add(x1, x2):
        shapes = [getattr(x, "shape", None) for x in (x1, x2)]
        if any(s is None or getattr(s, "rank", 0) is None for s in shapes):
            return original(x1, x2)
        if not misread_as_bias(list(shapes[0]), list(shapes[1])):
            return original(x1, x2)
        import tensorflow as tf
        from keras.src.backend.common import dtypes

        x1, x2 = tf.convert_to_tensor(x1), tf.convert_to_tensor(x2)
        dtype = dtypes.result_type(x1.dtype, x2.dtype)
        return tf.add(tf.cast(x1, dtype), tf.cast(x2, dtype))

    setattr(add, _MARK, True)
    return add
