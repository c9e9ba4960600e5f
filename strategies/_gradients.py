"""Adding gradients the way TensorFlow's tape does, so the optimizer sees what Keras gives it.

An `Embedding` (any `gather`) has a sparse gradient: `tf.IndexedSlices` with one row per
token of the batch, a token seen twice giving two rows. Keras's optimizers do not always
add those rows before they use them: Adam, RMSprop, Adagrad and AdamW square the slices
(`ops.square` keeps them sparse) and only then densify, so a repeated token contributes
the sum of its rows' squares, not the square of their sum; `clipnorm`/`global_clipnorm`
measure the rows' norm the same way. On one device the tape hands the whole batch's rows
to the optimizer. A model cut into micro-batches or replicas must therefore hand it the
same rows in the same order -- the micro-batches' (or replicas') slices concatenated in
batch order -- and never densify them first (a dense sum would be the textbook gradient,
but not Keras's result). This is exactly how the tape itself adds several sparse
gradients of one variable (`tf.IndexedSlices` concatenated); as there, a sparse and a dense
gradient add up to a dense one.
"""

import tensorflow as tf

__all__ = ["add", "add_n", "scale"]


def add_n(gradients):
    """The sum of one variable's gradients (None entries skipped; None if all are None)."""
    present = [g for g in gradients if g is not None]
    if not present:
        return None
    if len(present) == 1:
        return present[0]
    if all(isinstance(g, tf.IndexedSlices) for g in present):
        return tf.IndexedSlices(
            tf.concat([g.values for g in present], axis=0),
            tf.concat([tf.cast(g.indices, present[0].indices.dtype) for g in present], axis=0),
            present[0].dense_shape,
        )
    return tf.add_n([tf.convert_to_tensor(g) for g in present])


def add(a, b):
    """`a + b` for two gradients of one variable (either may be None)."""
    return add_n([a, b])


def scale(gradient, factor):
    """`gradient * factor`, keeping a sparse gradient sparse."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values * factor, gradient.indices, gradient.dense_shape)
    return gradient * factor
