"""`ModelSplitStrategy`: a Keras model split over devices, by layers or within layers."""

import weakref

import keras

from tfscale import _strategy_spec as _spec
from tfscale.compat import keras_add
from tfscale.strategies import _partition, _parts
from tfscale.strategies._devices import local_device_names, resolve_devices
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check, reject_unknown
from tfscale.strategies._placement import clone_chain
from tfscale.strategies._replicas import check_data_parallel, group_devices
from tfscale.strategies.model_split.graph import SplitGraph, graph_split
from tfscale.strategies.model_split.layers import ModelSplitError
from tfscale.strategies.model_split.models import DataParallelSplit, SplitSequential
from tfscale.strategies.model_split.tensor_split import model_input, tensor_split

__all__ = ["ModelSplitStrategy"]

_CUT_KEYS = ("calls", "takes", "gives", "gives_bytes", "shared")


class ModelSplitStrategy:
    """Splits a Keras model over devices so each device holds and computes only its part.

    Layer split (default): the model's chain of layers is cut into consecutive groups, one
    per device, balanced by parameters, layer count, measured time, or explicit counts;
    each group's variables are created on its device and its layers run there, the
    activations moving between devices. Any other functional graph (branches, skips across
    devices, several inputs and outputs, shared layers, raw `keras.ops` calls) is cut the
    same way between its calls in topological order, each device taking every tensor live
    across its cut. Tensor split (`tensor_parallel=K`): each Dense,
    Embedding and MultiHeadAttention layer is replaced by its Megatron-style split form
    (see `tfscale.strategies.model_split.layers`), K weight shards on K devices.

    `split(model)` returns an ordinary Keras model (`compile`, `fit`, `evaluate`,
    `predict`, `save_weights` work) with the original's weights; `merge(split_model)`
    returns the unsplit model with the trained weights. This is not a
    `tf.distribute.Strategy`: there is one replica, so no `scope()` is needed.

    The options' types and defaults are the fields of `tfscale._strategy_spec.ModelSplitOptions`
    (`cpu_replicas` there is `get("model_split")`'s alone).

    Args:
        devices: device names, one per part (e.g. `["/gpu:0", "/gpu:1"]`).
        num_devices: alternatively, how many devices: the first K GPUs, else K logical CPU
            devices (the host CPU is split if TensorFlow has not started yet).
        balance: layer split only: "parameters", "uniform", "time" (needs
            `sample_input`), or a list of layer counts per device.
        tensor_parallel: False (layer split), or True / K (tensor split over all K devices).
        tensor_layers: tensor split only: names of the layers to split; None splits every
            top-level Dense, Embedding and MultiHeadAttention layer.
        sample_input: a batch for the model, used by `balance="time"`; may also be
            given to `split`, like the pipeline's (which wins).
        data_parallel: D copies of the split model, each on its own group of K devices
            (`devices`: D x K names, replica r on devices[r*K:(r+1)*K]; `num_devices`: K,
            the devices of one copy). Each copy takes 1/D of every batch and each part's
            gradients are summed over the copies before the update; `split` then returns
            a `DataParallelSplit`.

    Raises:
        StrategyError: devices that do not exist here, or options that contradict each other.

    Example:

    >>> strategy = tfscale.strategies.get("model_split", num_devices=2)
    >>> split = strategy.split(model)
    >>> split.compile(optimizer="adam", loss="mse")
    >>> split.fit(x, y, epochs=3)
    >>> strategy.report(split)  # per device: layers, params, param_bytes
    """

    __signature__ = _spec.signature("model_split")  # help() lists each option with its default

    def __init__(self, **options):
        accepted = list(self.__signature__.parameters)
        reject_unknown("model_split", set(options) - set(accepted), accepted)
        options = _spec.OPTIONS["model_split"](**options)
        # A micro-batch or a copy's slice has fewer rows than the user's batch: Keras's `add`
        # must not meet the one size where it adds a (batch, 1) term along the channels.
        keras_add.add_by_broadcasting()
        balance, tensor_parallel, tensor_layers = (
            options.balance,
            options.tensor_parallel,
            options.tensor_layers,
        )
        self.data_parallel = check_data_parallel(options.data_parallel, 1, None, count_argument="num_devices")
        self._all_devices = _resolve_devices(
            options.devices, options.num_devices, tensor_parallel, self.data_parallel
        )
        self._groups = group_devices(self._all_devices, self.data_parallel)
        self._devices = self._groups[0]
        self._tensor = _check_tensor_parallel(tensor_parallel, len(self._devices))
        if not isinstance(balance, (list, tuple)) and balance not in _spec.BALANCE_METHODS:
            raise StrategyError(
                f"Invalid value for argument `balance`. Received: balance={balance!r}. Expected one "
                f"of {list(_spec.BALANCE_METHODS)} or a list of layer counts per device."
            )
        if tensor_layers is not None and not self._tensor:
            raise StrategyError(
                f"Argument `tensor_layers={tensor_layers!r}` needs tensor split. Expected "
                "`tensor_parallel=True` (or the number of devices) with it."
            )
        self._balance, self._tensor_layers, self._sample_input = balance, tensor_layers, options.sample_input
        self._origins = weakref.WeakKeyDictionary()  # split model -> _parts.Origin
        self._whole = weakref.WeakKeyDictionary()  # tensor split -> {layer: why not split}
        self._cuts = weakref.WeakKeyDictionary()  # layer split of a graph -> its parts (`_graph.describe`)
        self.placement = None

    @property
    def devices(self):
        """The device names, one per part (of every replica, in order, when data parallel)."""
        return list(self._all_devices)

    @property
    def num_devices(self):
        """Devices of one copy of the model (K)."""
        return len(self._devices)

    def split(self, model, *, sample_input=None):
        """Returns a split copy of a built `model`, with its weights.

        Args:
            model: a built Keras model: Sequential or functional, any graph (branches, skip
                connections, several inputs and outputs, shared layers, raw `keras.ops`
                calls). Layer split cuts a chain between layers (a `SplitSequential`), any
                other graph between its calls in topological order, every tensor live
                across a cut carried over it (a `SplitGraph`, `_graph.plan`).
            sample_input: a batch for the model; needed by balance="time" (else the one
                given to the constructor is used).

        Returns:
            A `keras.Model` of the same layers (Sequential for layer split of a chain) whose
            variables live on the devices; `self.placement` describes the parts of a layer
            split (for a graph: also the calls of each part and the tensors crossing its cuts).

        Raises:
            BalanceError: layer split of a subclassed model (its call is Python, not a
                graph), of too few layers (or calls), or balance="time" on a graph.
            ModelSplitError: unbuilt model; tensor split of a layer named in
                `tensor_layers` that cannot be split exactly (unsupported type or option,
                dimension not divisible by the number of devices), or of a model with no
                layer that can. Without `tensor_layers`, such layers are left whole on the
                first device, and `report()` says why.
        """
        sample = self._sample_input if sample_input is None else sample_input
        # Replica 0 last, so that `self.placement` describes it.
        outcomes = [self._split_on(model, group, sample) for group in self._groups[::-1]][::-1]
        copies = [copy for copy, _ in outcomes]
        split = copies[0] if len(copies) == 1 else DataParallelSplit(copies)
        if outcomes[0][1] is not None:
            self._whole[split] = outcomes[0][1]
        if isinstance(copies[0], SplitGraph):
            self._cuts[split] = self.placement
        self._origins[split] = _parts.Origin(model)
        for copy in copies:
            copy.remember_origin(self._origins[split])
        return split

    def _split_on(self, model, devices, sample_input):
        """(split model, {layer: why not split} for a tensor split, else None) on `devices`."""
        if self._tensor:
            return tensor_split(model, devices, self._tensor_layers)
        return self._layer_split(model, devices, sample_input), None

    def _layer_split(self, model, devices, sample_input):
        if not isinstance(model, keras.Sequential) and not _partition.is_chain(model):
            # Branches, skips, several inputs or outputs, shared layers, raw ops: the graph's
            # calls are cut in topological order, every live tensor carried across each cut.
            split, self.placement = graph_split(model, devices, self._balance, name=f"{model.name}_split")
            return split
        layers = _partition.chain_layers(model)
        counts = _partition.balance(layers, len(devices), self._balance, sample_input)
        inputs = model_input(model)
        copies, placement, _ = clone_chain(layers, counts, devices, inputs)
        split = SplitSequential(
            [model_input(model), *copies],
            placement=placement,
            name=f"{model.name}_split",
            output_structure=_output_structure(model),
        )
        self.placement = _partition.describe(split.layers, counts, devices)
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
        primary = getattr(split_model, "primary", split_model)
        return _parts.merge(self._origins[split_model], primary, compiled=split_model)

    def report(self, split_model):
        """Per device, read from each variable's device: layers, params and param bytes.

        Returns:
            A list of dicts (one per device, in order) with keys "device", "layers",
            "params", "param_bytes"; model variables only (optimizer slots not counted).
            For a layer split of a graph (not a chain), also "calls" (the calls run on this
            device, `name#k` for the k-th call of a shared layer), "takes" and "gives" (the
            tensors crossing the cut before and after its part: every live tensor, skips
            passing through included) and "shared" ({layer: the device it lives on} for a
            shared layer called here but placed on another device). For a tensor split,
            also "split_layers" (the layers with a shard on this device) and "whole_layers"
            ({layer name: why it was not split} for the layers held whole on this device).
        """
        models = getattr(split_model, "replica_models", [split_model])
        rows = _parts.report([layer for m in models for layer in m.layers], self._all_devices)
        cuts = self._cuts.get(split_model)
        if cuts is not None:
            for row in rows:
                part = next((p for p in cuts if p["device"] == row["device"]), None)
                if part is not None:
                    row.update({key: part[key] for key in _CUT_KEYS})
        whole = self._whole.get(split_model)
        if whole is not None:
            for row in rows:
                row["split_layers"] = [name for name in row["layers"] if name not in whole]
                row["whole_layers"] = {name: whole[name] for name in row["layers"] if name in whole}
        return rows


def _output_structure(model):
    """The structure of a chain's one output when it is not a bare tensor (a dict, a list)."""
    output = None if isinstance(model, keras.Sequential) else model.output
    if output is None or not isinstance(output, (dict, list, tuple)):
        return None
    return keras.tree.map_structure(lambda _: 0, output)


def _resolve_devices(devices, num_devices, tensor_parallel, data_parallel):
    if devices is not None and num_devices is not None:
        raise StrategyError(
            "Arguments `devices` and `num_devices` of strategy 'model_split' exclude each other. "
            "Expected one of them."
        )
    if devices is None and num_devices is None and not isinstance(tensor_parallel, bool):
        num_devices = tensor_parallel
    if data_parallel == 1:
        return resolve_devices(devices, num_devices, count_argument="num_devices", distinct=True)
    if devices is not None:
        names = resolve_devices(devices, None, count_argument="num_devices", distinct=True)
        if len(names) % data_parallel:
            raise StrategyError(
                f"Invalid value for argument `devices`. Received: {len(names)} devices for "
                f"data_parallel={data_parallel}. Expected data_parallel x K devices (K per copy)."
            )
        return names
    per_copy = check("num_devices", num_devices)
    try:
        return resolve_devices(None, data_parallel * per_copy, count_argument="num_devices", distinct=True)
    except StrategyError:
        have = len(local_device_names("GPU") or local_device_names("CPU"))
        check_data_parallel(data_parallel, per_copy, have, count_argument="num_devices")
        raise


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
