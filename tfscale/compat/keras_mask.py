"""Reading the Keras mask attached to a tensor (e.g. by `Embedding(mask_zero=True)`).

Upstream gap: Keras 3 attaches masks to tensors and offers no public getter;
`MultiHeadAttention` itself reads them with `keras.src.backend.get_keras_mask`. The
tensor-split attention must read the same mask to compute the same attention, and a layer
split must carry it across each device hop (a hop makes new tensors, which carry no mask)
as Keras carries it from layer to layer, with `keras.src.backend.set_keras_mask`.

Checked on Keras 3.15.1 / TensorFlow 2.21 (the function exists in Keras 3.0-3.15).
Gate: the import below (an `ImportError` names this module); `tests/test_compat_strategies.py`
fails when the mask Keras attaches is no longer what this returns.
"""

__all__ = ["get_keras_mask", "set_keras_mask"]


def get_keras_mask(x):
    """The mask Keras attached to tensor `x`, or None."""
    from keras.src.backend import get_keras_mask as upstream

    return upstream(x)


def set_keras_mask(x, mask):
    """Attaches `mask` to tensor `x` as Keras layers do (None clears it)."""
    from keras.src.backend import set_keras_mask as upstream

    upstream(x, mask)
