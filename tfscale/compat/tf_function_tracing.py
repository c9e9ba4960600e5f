"""Silence TensorFlow's "frequent retracing" warning for functions traced once per `fit`.

Upstream behaviour (checked on TF 2.16-2.21): `tf.function` counts traces per source
line across all function objects made there, and after 5 warns "triggered tf.function
retracing". tfscale's backup callback makes one small function per `fit` (it captures
that model's variables), so a process running many short `fit`s (a notebook, a test
suite, a hyper-parameter sweep) would get the warning though no function is ever
retraced. TensorFlow's own Keras-facing functions opt out with the private attribute
`_omit_frequent_tracing_warning`; this module is the one place tfscale sets it.

Gate: the attribute must exist on a `tf.function` object; where it does not, nothing is
set (the warning may then appear; training is unaffected).
"""

import tensorflow as tf

__all__ = ["quiet_retracing", "supported"]

_ATTRIBUTE = "_omit_frequent_tracing_warning"


def supported():
    """Whether this TensorFlow has the private opt-out (tested: fails if upstream drops it)."""
    return hasattr(tf.function(lambda: None), _ATTRIBUTE)


def quiet_retracing(function):
    """Marks the `tf.function` `function` as traced on purpose; returns it."""
    if hasattr(function, _ATTRIBUTE):
        setattr(function, _ATTRIBUTE, True)
    return function
