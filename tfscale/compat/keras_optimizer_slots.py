"""Optimizer slot variables on their model variable's device (Keras 3, TF backend).

Upstream gap: Keras's TF optimizer creates slots (Adam's momentum and velocity, SGD's
momentum) under the distribution strategy's `colocate_vars_with`, which the default
strategy ignores. Built eagerly they happen to follow their variable; built where `fit`
builds them, in the first traced step, every slot lands on the default device: a pipeline or
model split would hold all optimizer state on device 0, doubling or tripling its memory.
No public option chooses the slot device; `add_variable_from_reference` is the
optimizer's public hook for slots, so it is wrapped on the one optimizer instance.

The same gap places the *update* of each variable: the default strategy's
`extended.update` does not colocate `update_step` with its variable, so its arithmetic
runs on the default device, reading the variable and its slots from their device and
writing them back. Across hosts that moved 5x a remote stage's parameter bytes over the
network every step (measured: 5.4 MB per step for a 1 MB stage, see the README's "Across
hosts"); `update_step`, the optimizer's public per-variable hook, is wrapped to run on the
variable's device. Before it, Keras's TF optimizer passes every gradient through the
strategy's all-reduce (`_all_reduce_sum_gradients`, private; an identity under the
default strategy, created on the default device): the gradient of a remote variable went
to the client and back (2x its bytes per step). Outside any `tf.distribute` strategy it
is run per variable on the variable's device (the same identity).

Checked on Keras 3.15.1 / TensorFlow 2.21 (the gap exists in Keras 3.0-3.15).
Gate: `needed()`; `tests/test_compat_strategies.py` fails when a Keras version places
slots with their variables by itself (then set `_FIXED_IN`).
"""

import functools

import keras
import tensorflow as tf

from tfscale.compat.keras_multi_worker import _version_tuple

__all__ = ["needed", "place_slots_with_variables"]

# The first Keras version that places slots with their variables (None: not fixed yet).
_FIXED_IN = None
_MARK = "_tfscale_placed_slots"


def needed(version=None):
    """True when this Keras version creates slots on the default device."""
    version = _version_tuple(version or keras.__version__)
    return _FIXED_IN is None or version < _version_tuple(_FIXED_IN)


def place_slots_with_variables(optimizer):
    """Makes `optimizer` create each slot variable on the device of its model variable.

    Idempotent; a no-op where upstream is fixed.
    """
    original = optimizer.add_variable_from_reference
    if not needed() or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def placed(reference_variable, *args, **kwargs):
        with tf.device(getattr(reference_variable, "value", reference_variable).device):
            return original(reference_variable, *args, **kwargs)

    update = optimizer.update_step

    @functools.wraps(update)
    def update_on_device(gradient, variable, *args, **kwargs):
        with tf.device(_backing(variable).device):
            return update(gradient, variable, *args, **kwargs)

    reduce = getattr(optimizer, "_all_reduce_sum_gradients", None)

    def reduce_on_device(grads_and_vars):
        if tf.distribute.has_strategy():
            return reduce(grads_and_vars)  # Several replicas: their all-reduce, as Keras does it.
        reduced = []
        for gradient, variable in grads_and_vars:
            if gradient is None:  # Keras drops these itself; alone, one would be an error.
                reduced.append((gradient, variable))
                continue
            with tf.device(_backing(variable).device):
                reduced += reduce([(gradient, variable)])
        return reduced

    setattr(placed, _MARK, True)
    # The optimizer tracks attributes it is given; a bound hook is not state, so bypass that.
    object.__setattr__(optimizer, "add_variable_from_reference", placed)
    object.__setattr__(optimizer, "update_step", update_on_device)
    if reduce is not None:
        object.__setattr__(optimizer, "_all_reduce_sum_gradients", reduce_on_device)


def _backing(variable):
    """The tf.Variable behind a Keras variable (Keras passes either; a tf.Variable's `value`
    is a method)."""
    return variable if isinstance(variable, tf.Variable) else variable.value
