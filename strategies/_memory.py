"""`memory_report(model)`: the bytes of training state each device holds at rest.

Read from the variables actually placed: every component of a distributed variable counts
on the device it lives on (a mirrored weight N times, a ZeRO shard once per replica at its
shard's size, padding included).
"""

import collections

import keras
import tensorflow as tf

__all__ = ["memory_report"]

_KINDS = ("parameters", "optimizer", "gradients")
_ACCUMULATOR = "gradient_accumulator"  # Keras's name for gradient_accumulation_steps' buffers


def _components(variable):
    value = variable.value if isinstance(variable, keras.Variable) else variable
    if isinstance(value, tf.distribute.DistributedValues):
        return list(value.values)
    return [value]


def _bytes(component):
    return component.shape.num_elements() * component.dtype.size


def _optimizer_variables(optimizer):
    seen, out = set(), []
    for owner in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        for variable in getattr(owner, "variables", None) or []:
            if id(variable) not in seen:
                seen.add(id(variable))
                out.append(variable)
    return out


def memory_report(model):
    """Bytes held at rest on each device by parameters, optimizer state and gradient buffers.

    Args:
        model: a Keras model; its optimizer's variables count once it has been built
            (by the first `fit`, or `model.optimizer.build(model.trainable_variables)` in
            `strategy.scope()`).

    Returns:
        A dict mapping each device name (as TensorFlow names the device) to a dict with the
        keys "parameters" (the model's weights), "optimizer" (slots, step counters, ZeRO's
        parameter shards) and "gradients" (gradient accumulation buffers: gradients
        themselves live only during a step), in bytes.

    Example:

    >>> strategy = tfscale.strategies.get("mirrored", cpu_replicas=2, zero_stage=1)
    >>> with strategy.scope():
    ...     model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    ...     model.compile("adam", "mse")
    ...     model.optimizer.build(model.trainable_variables)
    >>> sorted(tfscale.strategies.memory_report(model))  # doctest: +ELLIPSIS
    ['/job:localhost/replica:0/task:0/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:1']
    """
    report = collections.defaultdict(lambda: dict.fromkeys(_KINDS, 0))
    groups = [("parameters", model.weights)]
    if getattr(model, "optimizer", None) is not None:
        variables = _optimizer_variables(model.optimizer)
        grads = [v for v in variables if v.path.endswith(_ACCUMULATOR)]
        states = [v for v in variables if not v.path.endswith(_ACCUMULATOR)]
        groups += [("optimizer", states), ("gradients", grads)]
    for kind, variables in groups:
        for variable in variables:
            for component in _components(variable):
                report[tf.DeviceSpec.from_string(component.device).to_string()][kind] += _bytes(component)
    return {device: dict(kinds) for device, kinds in sorted(report.items())}
