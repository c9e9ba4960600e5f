"""Several `MirroredStrategy` objects in one process without collective-key clashes.

Every `tf.distribute.MirroredStrategy` on CPU devices all-reduces with collective ops
whose group keys start at `1 + MirroredStrategy._collective_key_base` (a private class
attribute, 0 by default). A second strategy over a different number of devices in the
same process reuses group key 1 with another group size and aborts ("Device CPU:0 is
joining a group with size 4, but that group has size 2"). TensorFlow's own test
combinations (tensorflow/python/distribute/strategy_combinations.py, TF 2.x through
2.21) work around it the same way: bump the base by 100000 after each strategy.
Applies to every TF version that has the attribute; without it this is a no-op.
"""

import tensorflow as tf

__all__ = ["reserve_key_range"]

_STRIDE = 100_000


def reserve_key_range(strategy_cls=tf.distribute.MirroredStrategy):
    """Moves the next `strategy_cls` to a fresh collective-key range (call after building one)."""
    if hasattr(strategy_cls, "_collective_key_base"):
        strategy_cls._collective_key_base += _STRIDE
