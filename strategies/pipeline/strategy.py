"""`PipelineStrategy`: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V pipelines for Keras 3 on TensorFlow.

The user's model (a `keras.Sequential`, or any functional model) is cut into S consecutive
stages by the shared partitioner, and copied so that each stage's variables live on its
device. A chain is cut between layers; any other functional graph (branches, skips, several
inputs and outputs, raw `keras.ops` calls, nested models) between its calls in topological
order, every tensor live across a cut carried over it (`pipeline.graph`). `split` (alias
`wrap`) returns a `PipelinedModel`, a `keras.Model` whose `train_step` splits each batch into
M micro-batches and runs the schedule in one graph; `compile`, `fit`, `evaluate`,
`predict`, callbacks and `save_weights` stay Keras's.

Example:

>>> strategy = tfscale.strategies.get("pipeline", num_stages=2, num_microbatches=4)
>>> pipelined = strategy.split(model)         # model: a built keras.Sequential
>>> pipelined.compile(optimizer="sgd", loss="mse")
>>> pipelined.fit(x, y, batch_size=32)
>>> pipelined.save_weights("w.weights.h5")    # model.load_weights("w.weights.h5") works
>>> trace = pipelined.trace_step(x[:32], y[:32])  # one profiled step
>>> plot_timeline(trace, "timeline.png")        # Gantt chart, measured bubble in the title
>>> strategy.report(pipelined)                 # per device: layers, params, param_bytes
>>> unsplit = strategy.merge(pipelined)        # the user's architecture, trained weights
"""

import logging

import keras

from tfscale import _strategy_spec as _spec
from tfscale.compat import keras_add
from tfscale.strategies import _partition, _parts, _replicas
from tfscale.strategies._devices import available_devices, device_key, device_type, resolve_devices
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check, reject_unknown
from tfscale.strategies._placement import clone_chain, model_input, variable_device
from tfscale.strategies._replicas import check_data_parallel, draw_as_whole_batch, group_devices
from tfscale.strategies.pipeline import schedules
from tfscale.strategies.pipeline.batchnorm import DeferredBatchNorm, EmptyMicrobatchGuard

__all__ = ["PipelineStrategy"]

_log = logging.getLogger("tfscale")


class PipelineStrategy:
    """Pipeline parallelism: S stages on S devices, M micro-batches per batch.

    The options' types and defaults are the fields of `tfscale._strategy_spec.PipelineOptions`
    (`cpu_replicas` there is `get("pipeline")`'s alone), and the schedules' constraints its
    `SCHEDULES` entries; `tfscale-train`'s flags read the same.

    Args:
        num_stages: S, the number of stages (and devices).
        num_microbatches: M, micro-batches per batch; must divide every batch size.
        schedule: a name in `schedules.SCHEDULES`: "gpipe" (all forwards, then all
            backwards; M micro-batches of activations per stage), "1f1b" (one forward,
            one backward; at most S), "interleaved" (Megatron-LM's interleaved 1F1B over
            `virtual_stages` chunks per device; M a multiple of S), "zb-h1" (zero
            bubble: the weight gradient W split from the backward and deferred into the
            drain's idle slots; at most S per stage) or "zb-v" (zero bubble over two
            chunks per device placed in a V, device d holding chunks d and 2S - 1 - d;
            B and W split; needs virtual_stages=2; at most 2S chunk micro-batches, i.e.
            1F1B's S stage micro-batches, per device).
        virtual_stages: V, chunks of the chain per device ("interleaved", and 2 for
            "zb-v"): the model is cut into S x V stages, chunk c on device c mod S
            ("interleaved") or in a V ("zb-v").
        devices: S device names (D x S with `data_parallel=D`: replica r's stages on
            devices[r*S:(r+1)*S]), or None for the first D x S GPUs, else D x S logical
            CPU devices (the host CPU is split if TensorFlow has not started yet).
        balance: how to cut the layers: "parameters" (equal parameter counts),
            "uniform" (equal layer counts), "time" (equal measured forward + backward
            time; pass `sample_input` to `split`) or a list of S layer counts.
        recompute: recompute each stage's activations in its backward
            (`tf.recompute_grad`) instead of keeping them.
        serialize_stages: run each stage's ops one at a time, as a device stream does.
            None means True on CPU devices: logical CPU devices share one
            thread pool, and without it a stage could take every core. False lets
            TensorFlow run independent ops of one stage side by side.
        deferred_batch_norm: move BatchNormalization's moving averages once per batch,
            from the whole batch's statistics (combined from the M micro-batches'), so
            they equal the unsplit model's; False moves them once per micro-batch, as
            Keras would. Training-mode normalisation uses each micro-batch's own
            statistics either way. Not with `recompute` (a recomputed forward would be
            recorded twice): there it is off.
        data_parallel: D, copies of the whole pipeline; each takes 1/D of every batch
            (in order: replica r the r-th slice) and each stage's gradients are summed
            over the D copies by one all-reduce before the update (`strategies._replicas`).
            The batch size must then be a multiple of D x M.
        microbatch_statistics: with M > 1, accept GPipe's semantics for a trainable
            BatchNormalization: it normalises each micro-batch by that micro-batch's mean
            and variance, so losses and weights differ from one device's. False refuses
            such a model in `split`, naming the layer: results are plain Keras's or
            refused, never silently different. Irrelevant at M = 1. (Dropout-like layers
            draw one device's masks at any M: each micro-batch its rows of them.)

    Raises:
        StrategyError: an option out of range, or D x S more than the devices.
    """

    __signature__ = _spec.signature("pipeline")  # help() lists each option with its default

    def __init__(self, **options):
        accepted = list(self.__signature__.parameters)
        reject_unknown("pipeline", set(options) - set(accepted), accepted)
        options = _spec.OPTIONS["pipeline"](**options)
        # A micro-batch or a copy's slice has fewer rows than the user's batch: Keras's `add`
        # must not meet the one size where it adds a (batch, 1) term along the channels.
        keras_add.add_by_broadcasting()
        schedule, recompute = options.schedule, options.recompute
        deferred_batch_norm, serialize_stages = options.deferred_batch_norm, options.serialize_stages
        microbatch_statistics = options.microbatch_statistics
        self.num_stages = check("num_stages", options.num_stages)
        self.num_microbatches = check("num_microbatches", options.num_microbatches)
        self.virtual_stages = check("virtual_stages", options.virtual_stages)
        problem = _spec.schedule_problem(schedules.registered(schedule).constraints, options)
        if problem:
            raise StrategyError(problem)
        if not isinstance(recompute, bool):
            raise StrategyError(
                f"Invalid value for argument `recompute`. Received: recompute={recompute!r}. "
                "Expected True or False."
            )
        if not isinstance(deferred_batch_norm, bool):
            raise StrategyError(
                f"Invalid value for argument `deferred_batch_norm`. Received: "
                f"deferred_batch_norm={deferred_batch_norm!r}. Expected True or False."
            )
        self.deferred_batch_norm = deferred_batch_norm and not recompute
        if not isinstance(microbatch_statistics, bool):
            raise StrategyError(
                f"Invalid value for argument `microbatch_statistics`. Received: "
                f"microbatch_statistics={microbatch_statistics!r}. Expected True or False."
            )
        self.microbatch_statistics = microbatch_statistics
        if serialize_stages not in (None, True, False):
            raise StrategyError(
                f"Invalid value for argument `serialize_stages`. Received: "
                f"serialize_stages={serialize_stages!r}. Expected None, True or False."
            )
        self.schedule = schedule
        self.balance = options.balance
        self.recompute = recompute
        self.data_parallel = check_data_parallel(
            options.data_parallel, self.num_stages, None, count_argument="num_stages"
        )
        self.devices = _resolve(options.devices, self.num_stages, self.data_parallel)
        self.replica_devices = group_devices(self.devices, self.data_parallel)
        # The stage -> device map of replica 0: S x V chunks, chunk c on device c mod S
        # (round-robin), or in a V for ZB-V (device d: chunks d and 2S - 1 - d).
        self.stage_devices = schedules.stage_devices(
            self.replica_devices[0], self.num_stages * self.virtual_stages, schedule
        )
        if serialize_stages is None:
            serialize_stages = all(device_type(d) == "CPU" for d in self.devices)
        self.serialize_stages = serialize_stages

    def __repr__(self):
        return (
            f"PipelineStrategy(num_stages={self.num_stages}, num_microbatches={self.num_microbatches}, "
            f"schedule={self.schedule!r}, virtual_stages={self.virtual_stages}, devices={self.devices}, "
            f"balance={self.balance!r}, recompute={self.recompute}, "
            f"serialize_stages={self.serialize_stages}, deferred_batch_norm={self.deferred_batch_norm}, "
            f"data_parallel={self.data_parallel})"
        )

    def split(self, model, *, sample_input=None):
        """Cuts a built Keras model into stages and returns its pipelined copy.

        The returned model starts from `model`'s current weights; `model` itself is
        left as it was. `pipelined.partition` reports the chosen split.

        Args:
            model: a built `keras.Sequential` or functional model, any graph: a chain is
                cut between layers, any other graph between its calls in topological order
                (`pipeline.graph`: each stage takes every tensor live across the cut before
                it; `partition` names them). A shared layer's calls must fall in one stage.
            sample_input: a batch for the first layer; needed by balance="time" (chains only).

        Returns:
            A `PipelinedModel` (a `keras.Model`).

        Raises:
            BalanceError: the model cannot be cut (subclassed, fewer layers than stages,
                an invalid explicit balance, balance="time" on a graph, a shared layer
                called in two stages).
            StrategyError: the model is not built or has activity regularisers.
        """
        inputs = model_input(model) if model.built else None
        if inputs is None:
            raise StrategyError(
                f"Model {model.name!r} is not built. Expected a built model (keras.Input or "
                "model.build(input_shape)): its stages are placed on devices from their shapes."
            )
        if _is_graph(model):
            return self._split_graph(model)
        layers = _partition.chain_layers(model)
        self._refuse_layers(layers)
        call_kwargs = _call_kwargs(model, layers)
        counts = _partition.balance(layers, len(self.stage_devices), self.balance, sample_input)
        partition = _partition.describe(layers, counts, self.stage_devices)
        for part in partition:
            _log.info(
                "pipeline stage on %s: %d params, layers %s", part["device"], part["params"], part["layers"]
            )
        copies, _, _ = clone_chain(layers, counts, self.stage_devices, inputs)
        by_layer = dict(zip(map(id, layers), copies))
        # The same class, layer names and weights layout as the user's model (its weights
        # files load into it), made of the placed copies.
        unsplit = keras.models.clone_model(model, clone_function=lambda layer: by_layer[id(layer)])
        replicas = [self._stages(copies, counts, self.stage_devices, call_kwargs)]
        for devices in self._replica_stage_devices():
            # Replicas 1..D-1: untracked copies (replica 0 is the model Keras saves).
            copies_r = clone_chain(layers, counts, devices, inputs)[0]
            replicas.append(self._stages(copies_r, counts, devices, call_kwargs))
        return self._pipelined(model, unsplit, replicas, partition)

    wrap = split  # The first name of `split`, kept for callers.

    def _split_graph(self, model):
        """`split` of a functional graph that is not a chain (`pipeline.graph`)."""
        from tfscale.strategies.pipeline.graph import graph_stages

        def stages_on(devices):
            copy, stages, partition = graph_stages(
                model, devices, self.balance, self.recompute, self.serialize_stages
            )
            _check_placed(stages)
            return copy, stages, partition

        unsplit, stages, partition = stages_on(self.stage_devices)
        self._refuse_layers([layer for stage in stages for layer in stage.layers])
        for part in partition:
            _log.info(
                "pipeline stage on %s: %d params, calls %s, takes %s, gives %s",
                part["device"],
                part["params"],
                part["calls"],
                part["takes"],
                part["gives"],
            )
        replicas = [stages] + [stages_on(devices)[1] for devices in self._replica_stage_devices()]
        return self._pipelined(model, unsplit, replicas, partition)

    def _replica_stage_devices(self):
        """Per data-parallel replica 1..D-1, its S x V stage devices."""
        count = self.num_stages * self.virtual_stages
        return [schedules.stage_devices(group, count, self.schedule) for group in self.replica_devices[1:]]

    def _refuse_layers(self, layers):
        """Refuses what a pipeline of these options cannot train as one device does."""
        for layer in layers:
            if getattr(layer, "activity_regularizer", None) is not None:
                raise StrategyError(
                    f"Layer {layer.name!r} has an activity regulariser, which a pipeline cannot "
                    "sum over micro-batches like Keras does. Expected layers without one."
                )
        if self.num_microbatches > 1 and not self.microbatch_statistics:
            _refuse_per_microbatch_layers(layers, self.num_microbatches)
        if self.recompute:
            _refuse_stateful_layers_under_recompute(layers)

    def _pipelined(self, model, unsplit, replicas, partition):
        """The `PipelinedModel` of replicas' stages (replica 0's layers: `unsplit`'s)."""
        from tfscale.strategies.pipeline.model import PipelinedModel

        copies = [layer for stage in replicas[0] for layer in stage.layers]
        if self.data_parallel > 1 or self.num_microbatches > 1:
            # Each copy's and each micro-batch's Dropout draws its rows of one device's mask.
            for r, stages in enumerate(replicas):
                draw_as_whole_batch([layer for stage in stages for layer in stage.layers], r, len(replicas))
        origin = _parts.Origin(model)
        # Deferred statistics are gathered over one replica's micro-batches: with D > 1 each
        # replica's BatchNorm moves once per micro-batch, as Keras would (documented).
        deferred = self.deferred_batch_norm and self.data_parallel == 1
        every_copy = [layer for stages in replicas for stage in stages for layer in stage.layers]
        batch_norm = DeferredBatchNorm(copies) if deferred else EmptyMicrobatchGuard(every_copy)
        return PipelinedModel(
            unsplit,
            replicas[0],
            self.schedule,
            self.num_microbatches,
            partition,
            origin=origin,
            batch_norm=batch_norm,
            virtual_stages=self.virtual_stages,
            replicas=replicas,
        )

    def merge(self, pipelined):
        """The user's architecture (on the default device) holding `pipelined`'s weights.

        Raises:
            StrategyError: `pipelined` was not returned by a `PipelineStrategy.split`.
        """
        plan = getattr(pipelined, "_plan", None)
        if plan is None or plan.origin is None:
            raise StrategyError(
                f"Invalid value for argument `pipelined`: model {getattr(pipelined, 'name', pipelined)!r} "
                "was not returned by PipelineStrategy.split(). Expected the model split() returned."
            )
        return _parts.merge(plan.origin, pipelined.unsplit_model, compiled=pipelined)

    def report(self, pipelined):
        """Per device, read from each variable's device: layers, params and param bytes."""
        layers = [layer for stages in pipelined.replicas for stage in stages for layer in stage.layers]
        return _parts.report(layers, self.devices)

    def _stages(self, copies, counts, stage_devices, call_kwargs):
        from tfscale.strategies.pipeline.step import Stage

        stages, start = [], 0
        for index, (count, device) in enumerate(zip(counts, stage_devices)):
            stage = Stage(
                index,
                copies[start : start + count],
                device,
                self.recompute,
                self.serialize_stages,
                call_kwargs=call_kwargs[start : start + count],
            )
            start += count
            stages.append(stage)
        _check_placed(stages)
        return stages


def _is_graph(model):
    """Whether `model` is a functional graph that is not a chain of one input and output."""
    if isinstance(model, keras.Sequential):
        return False
    config = _partition.graph_config(model)
    if config is None:
        return False  # subclassed: `chain_layers` refuses it in one line
    return isinstance(config["output_layers"], dict) or not _partition.is_chain(model)


def _check_placed(stages):
    """Raises `StrategyError` if a stage's variable is not on its stage's device."""
    for stage in stages:
        for variable in (w for layer in stage.layers for w in layer.weights):
            if device_key(variable_device(variable)) != device_key(stage.device):
                raise StrategyError(
                    f"Variable {variable.path!r} of stage {stage.index} was created on "
                    f"{variable_device(variable)!r}, expected {stage.device!r}."
                )


def _call_kwargs(model, layers):
    """Per layer of the chain, the constant keyword arguments the model calls it with.

    A functional model records them in its config; a stage must call its copy the same
    way (`Stage`: with the call's `training`, as Keras does).

    Raises:
        StrategyError: a keyword argument that is not a plain constant (a tensor, an object).
    """
    config = _partition.graph_config(model)
    if config is None:
        return [{} for _ in layers]
    nodes = {entry["name"]: entry["inbound_nodes"] for entry in config["layers"]}
    found = []
    for layer in layers:
        kwargs = dict(nodes[layer.name][0].get("kwargs", {})) if nodes.get(layer.name) else {}
        for key, value in kwargs.items():
            if not isinstance(value, (bool, int, float, str, type(None))):
                raise StrategyError(
                    f"Layer {layer.name!r} is called with {key}={value!r}, which a pipeline stage "
                    "cannot pass on. Expected constant keyword arguments (bool, number, string)."
                )
        found.append(kwargs)
    return found


def _resolve(devices, num_stages, data_parallel):
    """D x S device names; too few devices for D > 1 names both numbers."""
    if data_parallel == 1:
        return resolve_devices(devices, num_stages, count_argument="num_stages", distinct=False)
    count = data_parallel * num_stages
    try:
        names = resolve_devices(devices, count, count_argument="data_parallel x num_stages", distinct=False)
    except StrategyError:
        if devices is not None:
            raise
        have = len(available_devices())
        check_data_parallel(data_parallel, num_stages, have, count_argument="num_stages")
        raise
    if len(set(map(device_key, names))) != count:
        raise StrategyError(
            f"Invalid value for argument `devices`. Received: devices={list(devices)!r}. Expected "
            f"{count} distinct devices for data_parallel={data_parallel} x num_stages={num_stages}."
        )
    return names


def _refuse_per_microbatch_layers(layers, num_microbatches):
    """Refuses layers whose training output depends on the whole batch at M > 1.

    (Random layers draw their rows of one device's numbers: `_replicas.draw_as_whole_batch`.)

    Raises:
        StrategyError: a trainable BatchNormalization (batch statistics), nested ones included.
    """
    for layer in _replicas.layer_tree(layers):
        if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
            raise StrategyError(
                f"Layer {layer.name!r} ({type(layer).__name__}) would normalise each micro-batch by its "
                f"own mean and variance at num_microbatches={num_microbatches}, not once for the whole "
                "batch as one device does (losses and weights would differ). Expected "
                "num_microbatches=1, the layer frozen (trainable=False: moving statistics), "
                "LayerNormalization, or microbatch_statistics=True to accept GPipe's per-micro-batch "
                "semantics."
            )


def _refuse_stateful_layers_under_recompute(layers):
    """Refuses layers whose training forward draws or moves state, under `recompute`.

    The recomputed forward must see the state the first one saw; in this version it does
    not always (seen: 1 run in 3 off by up to 0.01 with Dropout and BatchNormalization), so
    such a model is refused rather than trained differently.

    Raises:
        StrategyError: a trainable BatchNormalization or a random layer with a non-zero rate.
    """
    for layer in _replicas.layer_tree(layers):
        trainable_norm = isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
        if trainable_norm or _replicas.draws_in_training(layer):
            raise StrategyError(
                f"Layer {layer.name!r} ({type(layer).__name__}) changes state in its training forward, "
                "which recompute=True runs twice. Expected recompute=False, or the layer frozen "
                "(BatchNormalization) or at rate=0 (Dropout-like layers, an RNN's dropout and "
                "recurrent_dropout)."
            )
