"""A `tfscale-train --model=_elastic_model:slow_mlp` for the elastic tests: the registry MLP, slowed down.

Each step sleeps `TFSCALE_TEST_STEP_SLEEP` seconds (0 when unset) in an identity
layer, so a test can kill, shrink and grow a job while it trains; the layer has
no weights and returns its input, so the weights equal those of `--model=mlp`.
`TFSCALE_TEST_STEP_SLEEP=@FILE` reads the seconds from FILE at every step: the test
sets it to 0 once it has done what needed a slow job, and the rest trains at full speed.
"""

import os
import time

import keras
import numpy as np
import tensorflow as tf

from tfscale import models

__all__ = ["Sleep", "slow_mlp"]


def _seconds():
    value = os.environ.get("TFSCALE_TEST_STEP_SLEEP", "0")
    if value.startswith("@"):
        with open(value[1:]) as f:
            value = f.read().strip() or "0"  # empty: read while the test rewrote it
    return float(value)


@keras.saving.register_keras_serializable(package="tfscale_test")
class Sleep(keras.layers.Layer):
    """Identity that sleeps once per call of the compiled step (a `tf.py_function`)."""

    def call(self, x):
        def _sleep():
            time.sleep(_seconds())
            return np.float32(0)

        zero = tf.py_function(_sleep, [], tf.float32)
        zero.set_shape(())
        return x + zero

    def compute_output_shape(self, input_shape):
        return input_shape


def slow_mlp(input_shape, num_classes):
    mlp = models.mlp(input_shape, num_classes)
    inputs = keras.Input(input_shape)
    return keras.Model(inputs, mlp(Sleep()(inputs)), name="slow_mlp")
