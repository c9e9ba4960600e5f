"""`ModelSplitStrategy`: a Keras model split over devices, by layers or within layers."""

import weakref

import keras
import tensorflow as tf

from tfscale.strategies import _partition
from tfscale.strategies._devices import first_devices, parse_device
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._placement import device_of
from tfscale.strategies._split_models import SplitSequential
from tfscale.strategies._tensor_split import clone_layer, copy_weights, model_input, tensor_split
from tfscale.strategies.layers import ModelSplitError

__all__ = ["ModelSplitStrategy"]

_BALANCE_METHODS = ("parameters", "uniform", "time")


class ModelSplitStrategy:
    """Splits a Keras model over devices so each device holds and computes only its part.

    Layer split (default): the model's chain of layers is cut into consecutive groups, one
    per device, balanced by parameters, layer count, measured time, or explicit counts;
    each group's variables are created on its device and its layers run there, the
    activations moving between devices. Tensor split (`tensor_parallel=K`): each Dense,
    Embedding and MultiHeadAttention layer is replaced by its Megatron-style split form
    (see `tfscale.strategies.layers`), K weight shards on K devices.

    `split(model)` returns an ordinary Keras model (`compile`, `fit`, `evaluate`,
    `predict`, `save_weights` work) with the original's weights; `merge(split_model)`
    returns the unsplit model with the trained weights. This is not a
    `tf.distribute.Strategy`: there is one replica, so no `scope()` is needed.

    Args:
        devices: device names, one per part (e.g. `["/gpu:0", "/gpu:1"]`).
        num_devices: alternatively, how many devices: the first K GPUs, else K logical CPU
            devices (the host CPU is split if TensorFlow has not started yet).
        balance: layer split only: "parameters" (default), "uniform", "time" (needs
            `sample_input`), or a list of layer counts per device.
        tensor_parallel: False (layer split), or True / K (tensor split over all K devices).
        tensor_layers: tensor split only: names of the layers to split; None splits every
            top-level Dense, Embedding and MultiHeadAttention layer.
        sample_input: a batch for the model, used by `balance="time"`.

    Raises:
        StrategyError: devices that do not exist here, or options that contradict each other.

    Example:

    >>> strategy = tfscale.strategies.get("model_split", num_devices=2)
    >>> split = strategy.split(model)
    >>> split.compile(optimizer="adam", loss="mse")
    >>> split.fit(x, y, epochs=3)
    >>> strategy.report(split)  # per device: layers, params, param_bytes
    """

    def __init__(
        self,
        *,
        devices=None,
        num_devices=None,
        balance="parameters",
        tensor_parallel=False,
        tensor_layers=None,
        sample_input=None,
    ):
        self._devices = _resolve_devices(devices, num_devices, tensor_parallel)
        self._tensor = _check_tensor_parallel(tensor_parallel, len(self._devices))
        if not isinstance(balance, (list, tuple)) and balance not in _BALANCE_METHODS:
            raise StrategyError(
                f"Invalid value for argument `balance`. Received: balance={balance!r}. Expected one "
                f"of {list(_BALANCE_METHODS)} or a list of layer counts per device."
            )
        if tensor_layers is not None and not self._tensor:
            raise StrategyError(
                f"Argument `tensor_layers={tensor_layers!r}` needs tensor split. Expected "
                "`tensor_parallel=True` (or the number of devices) with it."
            )
        self._balance, self._tensor_layers, self._sample_input = balance, tensor_layers, sample_input
        self._origins = weakref.WeakKeyDictionary()  # split model -> (original class, config)
        self.placement = None

    @property
    def devices(self):
        """The device names, one per part."""
        return list(self._devices)

    @property
    def num_devices(self):
        return len(self._devices)

    def split(self, model):
        """Returns a split copy of a built `model`, with its weights.

        Args:
            model: a built Keras model: Sequential or functional. Layer split needs a chain
                (see `tfscale.strategies._partition.chain_layers`); tensor split any graph.

        Returns:
            A `keras.Model` of the same layers (Sequential for layer split) whose variables
            live on the devices; `self.placement` describes the parts of a layer split.

        Raises:
            BalanceError: layer split of a model that is not a chain or has too few layers.
            ModelSplitError: unbuilt model; tensor split of an unsupported layer, or of a
                dimension not divisible by the number of devices.
        """
        if self._tensor:
            split = tensor_split(model, self._devices, self._tensor_layers)
        else:
            split = self._layer_split(model)
        self._origins[split] = (type(model), model.get_config(), _custom_objects(model))
        return split

    def _layer_split(self, model):
        layers = _partition.chain_layers(model)
        counts = _partition.balance(layers, len(self._devices), self._balance, self._sample_input)
        x = model_input(model)
        clones, placement = [model_input(model)], []
        start = 0
        for count, device in zip(counts, self._devices):
            for layer in layers[start : start + count]:
                clone = clone_layer(layer)
                with tf.device(device):  # Variables are created (built) on their device.
                    x = clone(x)
                clones.append(clone)
                placement.append(device)
            start += count
        split = SplitSequential(clones, placement=placement, name=f"{model.name}_split")
        copy_weights(layers, split)
        self.placement = _partition.describe(split.layers, counts, self._devices)
        return split

    def merge(self, split_model):
        """The unsplit model (the original architecture) holding `split_model`'s weights.

        Use it to save in the original layout (`merge(split).save_weights(path)` loads into
        the original model), to export, or to evaluate on one device.

        Raises:
            ModelSplitError: `split_model` was not made by this strategy's `split`.
        """
        if split_model not in self._origins:
            raise ModelSplitError(
                f"Invalid value for argument `split_model`: model {split_model.name!r} was not "
                "returned by this strategy's split(). Expected the model split() returned."
            )
        cls, config, custom = self._origins[split_model]
        with keras.saving.custom_object_scope(custom):
            merged = cls.from_config(config)
        for layer in merged.layers:
            if not layer.weights:
                continue
            part = split_model.get_layer(layer.name)
            layer.set_weights(part.full_weights() if hasattr(part, "full_weights") else part.get_weights())
        return merged

    def report(self, split_model):
        """Per device, read from each variable's device: layers, params and param bytes.

        Returns:
            A list of dicts (one per device, in order) with keys "device", "layers",
            "params", "param_bytes"; model variables only (optimizer slots not counted).
        """
        rows = {d: {"device": d, "layers": [], "params": 0, "param_bytes": 0} for d in self._devices}
        for layer in split_model.layers:
            for variable in layer.weights:
                row = rows.setdefault(
                    device_of(variable),
                    {"device": device_of(variable), "layers": [], "params": 0, "param_bytes": 0},
                )
                size = int(tf.size(variable.value))
                row["params"] += size
                row["param_bytes"] += size * tf.as_dtype(variable.dtype).size
                if layer.name not in row["layers"]:
                    row["layers"].append(layer.name)
        return list(rows.values())


def _custom_objects(model):
    return {type(layer).__name__: type(layer) for layer in model.layers}


def _normalize(device):
    return parse_device(device, "devices")


def _resolve_devices(devices, num_devices, tensor_parallel):
    if devices is not None and num_devices is not None:
        raise StrategyError(
            "Arguments `devices` and `num_devices` of strategy 'model_split' exclude each other. "
            "Expected one of them."
        )
    if devices is None and num_devices is None and not isinstance(tensor_parallel, bool):
        num_devices = tensor_parallel
    if devices is not None:
        if isinstance(devices, str) or len(devices) < 1:
            raise StrategyError(
                f"Invalid value for argument `devices`. Received: devices={devices!r}. "
                "Expected a non-empty list of device names."
            )
        names = [_normalize(d) for d in devices]
        known = [d.name for d in tf.config.list_logical_devices()]
        missing = [d for d in names if d not in known]
        if missing or len(set(names)) != len(names):
            raise StrategyError(
                f"Invalid value for argument `devices`. Received: devices={list(devices)!r}. "
                f"Expected distinct devices among {known}."
            )
        return names
    return _first_devices(num_devices)


def _first_devices(num_devices):
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise StrategyError(
            f"Invalid value for argument `num_devices`. Received: num_devices={num_devices!r}. "
            "Expected a positive integer (or pass `devices`)."
        )
    return first_devices(num_devices, "num_devices")


def _check_tensor_parallel(tensor_parallel, num_devices):
    if isinstance(tensor_parallel, bool):
        return tensor_parallel
    if not isinstance(tensor_parallel, int) or tensor_parallel < 1 or tensor_parallel != num_devices:
        raise StrategyError(
            f"Invalid value for argument `tensor_parallel`. Received: tensor_parallel={tensor_parallel!r} "
            f"with {num_devices} device(s). Expected False, True, or {num_devices} (tensor split uses "
            "every device; combining layer and tensor split is not supported)."
        )
    return True
