"""`PipelineStrategy`: GPipe and 1F1B pipeline parallelism for Keras 3 models on TensorFlow.

The user's model (a `keras.Sequential`, or a functional model that is a chain of layers) is
cut into S consecutive stages by the shared partitioner, and copied so that each stage's
variables live on its device. `wrap` returns a `PipelinedModel`, a `keras.Model` whose
`train_step` splits each batch into M micro-batches and runs the schedule in one graph;
`compile`, `fit`, `evaluate`, `predict`, callbacks and `save_weights` stay Keras's.

Example:

>>> strategy = tfscale.strategies.get("pipeline", num_stages=2, num_microbatches=4)
>>> pipelined = strategy.wrap(model)          # model: a built keras.Sequential
>>> pipelined.compile(optimizer="sgd", loss="mse")
>>> pipelined.fit(x, y, batch_size=32)
>>> pipelined.save_weights("w.weights.h5")    # model.load_weights("w.weights.h5") works
>>> trace = pipelined.trace_step(x[:32], y[:32])  # one profiled step
>>> plot_timeline(trace, "timeline.png")        # Gantt chart, measured bubble in the title
"""

import logging

import tensorflow as tf

from tfscale.strategies import _partition, _pipeline_keras, _schedule
from tfscale.strategies._devices import first_devices
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._timeline import PipelineTrace
from tfscale.strategies._timeline import plot as plot_timeline

__all__ = ["PipelineStrategy", "PipelineTrace", "plot_timeline"]

_log = logging.getLogger("tfscale")


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected a positive integer."
        )
    return value


def _device_key(name):
    try:
        spec = tf.DeviceSpec.from_string(name)
    except (ValueError, TypeError):
        return None
    return (spec.device_type or "").upper(), spec.device_index or 0


def _resolve_devices(devices, num_stages):
    if devices is None:
        return first_devices(num_stages, "num_stages")
    devices = list(devices) if isinstance(devices, (list, tuple)) else None
    if devices is None or len(devices) != num_stages or not all(isinstance(d, str) for d in devices):
        raise StrategyError(
            f"Invalid value for argument `devices`. Received: devices={devices!r}. Expected a "
            f"list of {num_stages} device names (one per stage, num_stages={num_stages})."
        )
    known = sorted(d.name for d in tf.config.list_logical_devices())
    for device in devices:
        if _device_key(device) not in {_device_key(k) for k in known}:
            raise StrategyError(
                f"Invalid value for argument `devices`. Received: device {device!r}, which does "
                f"not exist here. Expected names from {known}."
            )
    return devices


class PipelineStrategy:
    """Pipeline parallelism: S stages on S devices, M micro-batches per batch.

    Args:
        num_stages: S, the number of stages (and devices).
        num_microbatches: M, micro-batches per batch; must divide every batch size.
        schedule: "gpipe" (all forwards, then all backwards; M micro-batches of
            activations per stage) or "1f1b" (one forward, one backward; at most S).
        devices: S device names, or None for the first S GPUs, else S logical CPU
            devices (the host CPU is split if TensorFlow has not started yet).
        balance: how to cut the layers: "parameters" (equal parameter counts),
            "uniform" (equal layer counts), "time" (equal measured forward + backward
            time; pass `sample_input` to `wrap`) or a list of S layer counts.
        recompute: recompute each stage's activations in its backward
            (`tf.recompute_grad`) instead of keeping them.
        serialize_stages: run each stage's ops one at a time, as a device stream does.
            None (default) means True on CPU devices: logical CPU devices share one
            thread pool, and without it a stage could take every core. False lets
            TensorFlow run independent ops of one stage side by side.

    Raises:
        StrategyError: an option out of range, or more stages than devices.
    """

    def __init__(
        self,
        *,
        num_stages=2,
        num_microbatches=4,
        schedule="1f1b",
        devices=None,
        balance="parameters",
        recompute=False,
        serialize_stages=None,
        **unknown,
    ):
        if unknown:
            raise StrategyError(
                f"Unknown option(s) {sorted(unknown)} for strategy 'pipeline'. Expected options: "
                "['num_stages', 'num_microbatches', 'schedule', 'devices', 'balance', 'recompute', "
                "'serialize_stages']."
            )
        self.num_stages = _positive_int("num_stages", num_stages)
        self.num_microbatches = _positive_int("num_microbatches", num_microbatches)
        if schedule not in _schedule.SCHEDULES:
            raise StrategyError(
                f"Invalid value for argument `schedule`. Received: schedule={schedule!r}. "
                f"Expected one of {list(_schedule.SCHEDULES)}."
            )
        if not isinstance(recompute, bool):
            raise StrategyError(
                f"Invalid value for argument `recompute`. Received: recompute={recompute!r}. "
                "Expected True or False."
            )
        if serialize_stages not in (None, True, False):
            raise StrategyError(
                f"Invalid value for argument `serialize_stages`. Received: "
                f"serialize_stages={serialize_stages!r}. Expected None, True or False."
            )
        self.schedule = schedule
        self.balance = balance
        self.recompute = recompute
        self.devices = _resolve_devices(devices, num_stages)
        if serialize_stages is None:
            serialize_stages = all(_device_key(d)[0] == "CPU" for d in self.devices)
        self.serialize_stages = serialize_stages

    def __repr__(self):
        return (
            f"PipelineStrategy(num_stages={self.num_stages}, num_microbatches={self.num_microbatches}, "
            f"schedule={self.schedule!r}, devices={self.devices}, balance={self.balance!r}, "
            f"recompute={self.recompute}, serialize_stages={self.serialize_stages})"
        )

    def wrap(self, model, *, sample_input=None):
        """Cuts a built Keras model into stages and returns its pipelined copy.

        The returned model starts from `model`'s current weights; `model` itself is
        left as it was. `pipelined.partition` reports the chosen split.

        Args:
            model: a built `keras.Sequential` or functional chain model.
            sample_input: a batch for the first layer; needed by balance="time".

        Returns:
            A `PipelinedModel` (a `keras.Model`).

        Raises:
            BalanceError: the model cannot be cut (branches, subclassed, fewer layers
                than stages, an invalid explicit balance).
            StrategyError: the model is not built or has activity regularisers.
        """
        from tfscale.strategies._pipeline_model import PipelinedModel

        layers = _partition.chain_layers(model)
        if not model.built:
            raise StrategyError(
                f"Model {model.name!r} is not built. Expected a built model (keras.Input or "
                "model.build(input_shape)): its stages are placed on devices from their shapes."
            )
        for layer in layers:
            if getattr(layer, "activity_regularizer", None) is not None:
                raise StrategyError(
                    f"Layer {layer.name!r} has an activity regulariser, which a pipeline cannot "
                    "sum over micro-batches like Keras does. Expected layers without one."
                )
        counts = _partition.balance(layers, self.num_stages, self.balance, sample_input)
        partition = _partition.describe(layers, counts, self.devices)
        for part in partition:
            _log.info(
                "pipeline stage on %s: %d params, layers %s", part["device"], part["params"], part["layers"]
            )
        unsplit = _placed_clone(model, layers, counts, self.devices)
        stages = _stages(unsplit, counts, self.devices, self.recompute, self.serialize_stages)
        return PipelinedModel(unsplit, stages, self.schedule, self.num_microbatches, partition)


def _placed_clone(model, layers, counts, devices):
    """The same model, each layer rebuilt (variables created) under its stage's device."""
    import keras

    device_of, start = {}, 0
    for count, device in zip(counts, devices):
        for layer in layers[start : start + count]:
            device_of[id(layer)] = device
        start += count

    def clone_layer(layer):
        with tf.device(device_of.get(id(layer), devices[0])):
            copy = layer.__class__.from_config(layer.get_config())
            if not copy.built:
                copy.build(layer.input.shape)
        copy.set_weights(layer.get_weights())
        return copy

    return keras.models.clone_model(model, clone_function=clone_layer)


def _stages(unsplit, counts, devices, recompute, serial):
    from tfscale.strategies._pipeline_step import Stage

    layers, stages, start = _partition.chain_layers(unsplit), [], 0
    for index, (count, device) in enumerate(zip(counts, devices)):
        stage = Stage(index, layers[start : start + count], device, recompute, serial)
        start += count
        for variable in (w for layer in stage.layers for w in layer.weights):
            if _device_key(_pipeline_keras.variable_device(variable)) != _device_key(device):
                raise StrategyError(
                    f"Variable {variable.path!r} of stage {index} was created on "
                    f"{_pipeline_keras.variable_device(variable)!r}, expected {device!r}."
                )
        stages.append(stage)
    return stages
