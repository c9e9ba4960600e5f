"""PipelineStrategy: same training as the unsplit model, bounded activations, Keras API, bad input.

Equivalence tolerance: losses and weights agree with the unsplit model trained on one device
to rtol=1e-5, atol=1e-6 (float32 round-off: a micro-batched gradient sums the same terms
in another order). Models and data are tiny, because each (S, M, schedule) is a graph of
its own to trace.
"""

import re
import shutil
import tempfile

import _model_helpers as helpers
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfscale.callbacks
import tfscale.strategies
from tfscale import _strategy_spec as spec
from tfscale.compat import tf_xplane
from tfscale.strategies import BalanceError, PipelineStrategy, StrategyError
from tfscale.strategies.pipeline import schedules as _schedule
from tfscale.strategies.pipeline import timeline as _timeline

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_training_equals_unsplit_model": 2,  # gpipe and 1f1b at M=1; M=2 in the full suite
    "test_live_activations_bounded_by_schedule_in_a_measured_run": 3,
    "test_deferred_batch_norm_moving_statistics_equal_the_unsplit_models": 2,
}


RTOL, ATOL = 1e-5, 1e-6
EPOCHS, BATCH, SAMPLES = 3, 16, 32


def _cnn(extra=0):
    inputs = keras.Input((6, 6, 2))
    x = keras.layers.Conv2D(4, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(4, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    for _ in range(extra):
        x = keras.layers.Dense(8, activation="tanh")(x)
    return keras.Model(inputs, keras.layers.Dense(3)(x), name="cnn")


_BUILDERS = {
    "mlp": (helpers.mlp, (6,)),
    "cnn": (_cnn, (6, 6, 2)),
    # The same models with 8 layers, for 8 chunks (interleaved S=4, V=2).
    "mlp8": (lambda: helpers.mlp(extra=4), (6,)),
    "cnn8": (lambda: _cnn(extra=2), (6, 6, 2)),
}


def _model(kind, seed=0):
    return helpers.seeded(_BUILDERS[kind][0], seed)


def _data(kind, samples=SAMPLES):
    return helpers.regression_data(_BUILDERS[kind][1], samples)


def _compile(model, **kwargs):
    return helpers.compile_sgd(model, 0.05, **kwargs)


def _fit(model, x, y, **kwargs):
    return helpers.fit(model, x, y, batch_size=BATCH, epochs=EPOCHS, **kwargs)


# The unsplit model trained on one device: kind -> (history, final weights), once per kind.
_reference = helpers.reference_runs(_model, _data, _compile, _fit)


def _wrap(kind, **options):
    options.setdefault("balance", "uniform")
    return PipelineStrategy(**options).wrap(_model(kind))


def _grid(schedules):
    return [
        pytest.param(kind, stages, micro, schedule, id=f"{kind}-{stages}-{micro}-{schedule}")
        for kind in ("mlp", "cnn")
        for stages in (2, 4)
        for micro in (1, 2, 4, 8)
        for schedule in schedules
    ]


# ZB-V (2 chunks per device) after the fast tier's first cases, on the same grid.
@pytest.mark.parametrize(
    ("kind", "num_stages", "num_microbatches", "schedule"), _grid(["gpipe", "1f1b"]) + _grid(["zb-v"])
)
def test_training_equals_unsplit_model(kind, num_stages, num_microbatches, schedule):
    virtual_stages = 2 if schedule == "zb-v" else 1
    # S x V chunks need as many layers: the 8-layer variant of the model, and its reference.
    model = kind + "8" if num_stages * virtual_stages > 4 else kind
    history, weights = _reference(model)
    pipelined = _compile(
        _wrap(
            model,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
    )
    got = _fit(pipelined, *_data(model))
    np.testing.assert_allclose(got["loss"], history["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["mae"], history["mae"], rtol=RTOL, atol=ATOL)
    for a, b in zip(pipelined.get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("serialize_stages", [None, False])
def test_recompute_and_sample_weights_train_like_unsplit_model(serialize_stages):
    x, y = _data("mlp")
    sample_weight = np.linspace(0.2, 2.0, SAMPLES).astype("float32")
    loss = keras.losses.MeanSquaredError(reduction="sum")
    with tf.device("/device:CPU:0"):
        reference = _model("mlp")
        reference.compile(optimizer=keras.optimizers.SGD(0.002), loss=loss)
        expected = _fit(reference, x, y, sample_weight=sample_weight)["loss"]
    pipelined = _wrap(
        "mlp", num_stages=2, num_microbatches=4, recompute=True, serialize_stages=serialize_stages
    )
    pipelined.compile(optimizer=keras.optimizers.SGD(0.002), loss=loss)
    got = _fit(pipelined, x, y, sample_weight=sample_weight)["loss"]
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    for a, b in zip(pipelined.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _forward_ops_in_backward(pipelined, x, y):
    """How many forward ops (not gradients) a profiled step ran inside backward groups."""
    pipelined.train_on_batch(x, y)
    logdir = tempfile.mkdtemp()
    tf.profiler.experimental.start(logdir)
    pipelined.train_on_batch(x, y)
    tf.profiler.experimental.stop()
    names = [name for name, _, _ in tf_xplane.op_events(logdir)]
    shutil.rmtree(logdir)
    forward = re.compile(r"^pipeline/s\d+_B\d+/.*:(_FusedMatMul|MatMul|Relu|Tanh)$")
    return sum(1 for name in names if forward.match(name))


def test_recompute_reruns_each_stage_forward_in_its_backward():
    x, y = _data("mlp")
    kept = _compile(_wrap("mlp", num_stages=2, num_microbatches=2))
    recomputed = _compile(_wrap("mlp", num_stages=2, num_microbatches=2, recompute=True))
    assert _forward_ops_in_backward(kept, x, y) == 0
    assert _forward_ops_in_backward(recomputed, x, y) > 0


def test_variables_and_optimizer_slots_live_on_their_stage_device():
    pipelined = _compile(_wrap("mlp", num_stages=4, num_microbatches=2))
    pipelined.fit(*_data("mlp"), batch_size=BATCH, epochs=1, verbose=0)
    for stage, device in zip(pipelined.stages, tfscale.strategies.split_cpu(4)):
        helpers.assert_stage_placed(stage, device, pipelined.optimizer)


def test_partition_reports_the_chosen_split():
    by_params = PipelineStrategy(num_stages=2, num_microbatches=2).wrap(_model("mlp"))
    assert [len(p["layers"]) for p in by_params.partition] == [2, 2]
    assert sum(p["params"] for p in by_params.partition) == _model("mlp").count_params()
    explicit = PipelineStrategy(num_stages=2, num_microbatches=2, balance=[1, 3]).wrap(_model("mlp"))
    assert [len(p["layers"]) for p in explicit.partition] == [1, 3]
    timed = PipelineStrategy(num_stages=2, num_microbatches=2, balance="time").wrap(
        _model("cnn"), sample_input=_data("cnn")[0][:8]
    )
    assert sum(len(p["layers"]) for p in timed.partition) == 6


@pytest.mark.parametrize(
    ("schedule", "serialize_stages"),
    [("gpipe", None), ("1f1b", None), ("1f1b", False), ("zb-v", None), ("zb-v", False)],
)
def test_live_activations_bounded_by_schedule_in_a_measured_run(schedule, serialize_stages, tmp_path):
    num_stages, num_microbatches = 4, 8
    virtual_stages = 2 if schedule == "zb-v" else 1
    kind = "mlp8" if schedule == "zb-v" else "mlp"  # 8 chunks for ZB-V: one layer each
    pipelined = _compile(
        _wrap(
            kind,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
            serialize_stages=serialize_stages,
        )
    )
    x, y = _data(kind)
    trace = pipelined.trace_step(x, y)
    orders = _schedule.order(schedule, 4, 8, virtual_stages)
    if schedule == "zb-v":
        # A chunk of one layer has no input gradient to compute in its first B (chunk 0)
        # or nothing left for W: such groups may be empty; every F is there.
        assert {s for s in trace.intervals if s.kind == _schedule.Kind.FORWARD} == {
            s for o in orders for s in o if s.kind == _schedule.Kind.FORWARD
        }
        assert set(trace.intervals) <= {s for o in orders for s in o}
        bound = _schedule.activation_bound("zb-v", 4, 8, 2)
        assert bound == [2 * num_stages] * num_stages  # 2S half-stage chunks: 1F1B's S stages
        assert trace.activation_bound == bound
        if serialize_stages is None:
            assert trace.live_activations == bound, trace.live_activations
        else:
            assert all(live <= b for live, b in zip(trace.live_activations, bound)), trace
    else:
        assert set(trace.intervals) == {s for o in orders for s in o}
    if schedule == "gpipe":
        assert trace.live_activations == [num_microbatches] * num_stages, trace
    elif schedule == "1f1b" and serialize_stages is None:
        # Each stage runs the 1F1B order exactly: stage s keeps S - s micro-batches alive.
        assert trace.live_activations == [4, 3, 2, 1], trace
    elif schedule == "1f1b":
        # Only the fewest waits: the executor may reorder, the bound S - s still holds.
        assert all(live <= num_stages - s for s, live in enumerate(trace.live_activations)), trace
    assert 0.0 <= trace.bubble < 1.0
    png = _timeline.plot(trace, tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_schedules_order_and_bound_activations():
    for s, order in enumerate(_schedule.order("1f1b", 4, 8)):
        alive = peak = 0
        for step in order:
            alive += 1 if step.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == 4 - s
    gpipe = _schedule.order("gpipe", 2, 3)[1]
    assert [(st.kind, st.microbatch) for st in gpipe] == [
        ("F", 0),
        ("F", 1),
        ("F", 2),
        ("B", 0),
        ("B", 1),
        ("B", 2),
    ]
    assert _schedule.theoretical_bubble(2, 8) == pytest.approx(1 / 9)


def test_evaluate_predict_and_weights_files_match_unsplit_model(tmp_path):
    x, y = _data("cnn")
    pipelined = _compile(_wrap("cnn", num_stages=2, num_microbatches=4))
    pipelined.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = str(tmp_path / "pipelined.weights.h5")
    pipelined.save_weights(path)
    unsplit = _compile(_model("cnn", seed=7))
    unsplit.optimizer.build(unsplit.trainable_variables)
    unsplit.load_weights(path)
    for a, b in zip(unsplit.get_weights(), pipelined.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(unsplit.optimizer.variables, pipelined.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    np.testing.assert_allclose(
        pipelined.predict(x, verbose=0), unsplit.predict(x, verbose=0), rtol=RTOL, atol=ATOL
    )
    np.testing.assert_allclose(
        pipelined.evaluate(x, y, verbose=0), unsplit.evaluate(x, y, verbose=0), rtol=RTOL
    )
    other = _wrap("cnn", num_stages=2, num_microbatches=2)
    other.load_weights(path)
    np.testing.assert_array_equal(other.get_weights()[0], pipelined.get_weights()[0])


@helpers.each_backup_class
def test_backup_and_restore_resumes_like_an_uninterrupted_run(tmp_path, backup_class):
    x, y = _data("mlp")
    expected, weights = _reference("mlp")
    backup = backup_class(str(tmp_path / "backup"))
    second, history = helpers.interrupted_then_resumed(
        _compile(_wrap("mlp", num_stages=2, num_microbatches=2)),
        lambda: _compile(_wrap("mlp", num_stages=2, num_microbatches=2, schedule="gpipe")),
        backup,
        lambda model, callbacks: _fit(model, x, y, callbacks=callbacks),
    )
    np.testing.assert_allclose(history["loss"], expected["loss"][1:], rtol=RTOL, atol=ATOL)
    helpers.assert_weights_close(second.get_weights(), weights, rtol=RTOL, atol=ATOL)


def test_get_routes_to_pipeline_strategy():
    strategy = tfscale.strategies.get("pipeline", num_stages=2, num_microbatches=2, schedule="gpipe")
    assert isinstance(strategy, PipelineStrategy)
    assert (strategy.num_stages, strategy.num_microbatches, strategy.schedule) == (2, 2, "gpipe")


def _branching_model():
    inputs = keras.Input((4,))
    h = keras.layers.Dense(4, name="first")(inputs)
    out = keras.layers.Add(name="skip")([h, keras.layers.Dense(4, name="second")(h)])
    return keras.Model(inputs, out)


def test_bad_input_raises_clear_value_errors():
    with pytest.raises(BalanceError, match="too few layers to make 5 parts"):
        PipelineStrategy(num_stages=5, devices=["/cpu:0"] * 5).wrap(_model("mlp"))
    with pytest.raises(StrategyError, match=r"`num_stages`.*num_stages=6"):
        PipelineStrategy(num_stages=6)
    with pytest.raises(StrategyError, match=r"`devices`.*list of 2 device names"):
        PipelineStrategy(num_stages=2, devices=["/cpu:0"])
    with pytest.raises(StrategyError, match=r"`devices`.*'/cpu:9', which does not exist"):
        PipelineStrategy(num_stages=2, devices=["/cpu:0", "/cpu:9"])
    with pytest.raises(BalanceError, match=r"balance='time' for model .*not a chain"):
        PipelineStrategy(num_stages=2, balance="time").wrap(_branching_model())
    with pytest.raises(StrategyError, match=r"`schedule`.*'zigzag'"):
        PipelineStrategy(schedule="zigzag")
    with pytest.raises(StrategyError, match=r"Unknown option\(s\) \['stages'\]"):
        tfscale.strategies.get("pipeline", stages=2)
    with pytest.raises(StrategyError, match="`jit_compile`"):
        _wrap("mlp", num_stages=2).compile(optimizer="sgd", loss="mse", jit_compile=True)


def test_tfscale_backup_of_a_finished_run_restores_into_a_new_pipelined_model(tmp_path):
    x, y = _data("mlp")
    backup = tfscale.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)
    first = _compile(_wrap("mlp", num_stages=2, num_microbatches=2))
    first.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    second = _compile(_wrap("mlp", num_stages=2, num_microbatches=2))
    second.set_weights([w + 1.0 for w in second.get_weights()])  # Only a restore can undo this.
    history = second.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[backup])
    assert history.history == {}  # Both epochs were restored, none re-run.
    assert len(second.get_weights()) == len(first.get_weights()) == 8  # 4 Dense: kernel, bias
    for a, b in zip(second.get_weights(), first.get_weights()):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(second.optimizer.variables, first.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("method", ["parameters", "time"])
def test_balance_reaches_the_partitioner(method, monkeypatch):
    model, x = helpers.uneven_mlp(), np.zeros((4, 7), "float32")
    layers = tfscale.strategies._partition.chain_layers(model)
    times = [1.0, 1.0, 1.0, 1.0, 9.0]  # "time": the last layer alone on one stage.
    if method == "time":
        helpers.fix_layer_times(monkeypatch, times)
    expected = tfscale.strategies._partition.balance(layers, 2, method, x)
    assert expected not in ([3, 2], [2, 3])  # unlike "uniform"
    if method == "time":
        helpers.fix_layer_times(monkeypatch, times)
    pipelined = PipelineStrategy(num_stages=2, num_microbatches=2, balance=method).split(
        model, sample_input=x
    )
    assert [len(part["layers"]) for part in pipelined.partition] == expected


def test_trace_step_advances_the_optimizer_by_one_step():
    x, y = _data("mlp", samples=8)
    traced = _compile(_wrap("mlp", num_stages=2, num_microbatches=2))
    trained = _compile(_wrap("mlp", num_stages=2, num_microbatches=2))
    traced.trace_step(x, y)
    trained.train_on_batch(x, y)
    assert int(traced.optimizer.iterations.numpy()) == 1
    for a, b in zip(traced.get_weights(), trained.get_weights()):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_split_merge_report_are_the_model_split_verbs():
    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, balance="uniform")
    model = _model("mlp")
    pipelined = strategy.split(model)
    assert PipelineStrategy.wrap is PipelineStrategy.split
    merged = strategy.merge(pipelined)
    assert type(merged) is type(model)
    x = _data("mlp")[0]
    np.testing.assert_allclose(merged(x), model(x), rtol=RTOL, atol=ATOL)
    rows = strategy.report(pipelined)
    assert [row["device"] for row in rows] == ["/device:CPU:0", "/device:CPU:1"]
    assert [row["params"] for row in rows] == [p["params"] for p in pipelined.partition]
    with pytest.raises(StrategyError, match=r"`pipelined`.*not returned by PipelineStrategy\.split"):
        strategy.merge(model)


def test_a_schedule_is_one_registered_function(monkeypatch):
    # A schedule is its spec entry (its constraints) and its function in the registry.
    monkeypatch.setitem(spec.SCHEDULES, "gpipe-copy", spec.SCHEDULES["gpipe"])
    monkeypatch.setitem(_schedule.SCHEDULES, "gpipe-copy", _schedule.SCHEDULES["gpipe"])
    x, y = _data("mlp")
    expected, _ = _reference("mlp")
    pipelined = _compile(_wrap("mlp", num_stages=2, num_microbatches=2, schedule="gpipe-copy"))
    history = _fit(pipelined, x, y)
    np.testing.assert_allclose(history["loss"], expected["loss"], rtol=RTOL, atol=ATOL)
    with pytest.raises(
        StrategyError,
        match=r"schedule='bogus'.*\['gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v', 'gpipe-copy'\]",
    ):
        tfscale.strategies.get("pipeline", schedule="bogus")


@pytest.mark.parametrize("kind", list(_schedule.Kind))
def test_op_names_parse_back_to_their_op(kind):
    op = _schedule.Op(3, kind, 11)
    name = _schedule.op_name(op)
    assert _schedule.parse_op_name(f"{name}/dense/MatMul:MatMul") == op
    backward = _schedule.Op(3, _schedule.Kind.BACKWARD, 11)
    assert _schedule.parse_op_name(f"gradient_tape/{name}/dense/MatMul") == (
        backward if kind == _schedule.Kind.FORWARD else op
    )
    assert _schedule.parse_op_name("model/dense/MatMul") is None


def test_stage_devices_map_v_stages_per_device():
    assert _schedule.stage_devices(["a", "b"], 2) == ["a", "b"]
    assert _schedule.stage_devices(["a", "b"], 4) == ["a", "b", "a", "b"]
    with pytest.raises(StrategyError, match="3 stages cannot be spread evenly over 2 devices"):
        _schedule.stage_devices(["a", "b"], 3)


@pytest.mark.parametrize("device_type", ["CPU", "GPU"])
def test_matmul_pretranspose_only_on_cpu_stages(device_type):
    """Eigen's CPU MatMul needs the pre-transposed weight; a GPU stage keeps `transpose_b`."""
    from tfscale.strategies.pipeline.step import Stage

    strategy = PipelineStrategy(num_stages=2, num_microbatches=2, balance="uniform")
    cpu_stages = strategy.split(_square_mlp()).stages
    # The graph is only built, never run, so GPU stages need no GPU here.
    stages = [Stage(s.index, s.layers, f"/device:{device_type}:{s.index}") for s in cpu_stages]
    assert [stage.pretranspose for stage in stages] == [device_type == "CPU"] * 2
    graph = _train_graph(stages)
    backward = [op for op in graph.get_operations() if op.type == "MatMul" and "gradient_tape" in op.name]
    transposed_b = [op for op in backward if op.get_attr("transpose_b")]
    assert backward and bool(transposed_b) is (device_type == "GPU")


def _square_mlp():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,))] + [keras.layers.Dense(8) for _ in range(4)])


def _train_graph(stages):
    from tfscale.strategies.pipeline import step

    @tf.function
    def batch(x):
        xs = tf.split(x, 2)
        return step.run_batch(stages, "1f1b", xs, lambda i, y: tf.reduce_sum(y))[2]

    return batch.get_concrete_function(tf.TensorSpec((4, 8), tf.float32)).graph


class _NormBlock(keras.layers.Layer):
    """A custom layer holding a BatchNormalization (found and deferred too)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norm = keras.layers.BatchNormalization(momentum=0.9)

    def call(self, x, training=None):
        return self.norm(x, training=training)


def _normalised_mlp(nested):
    keras.utils.set_random_seed(4)
    first = _NormBlock() if nested else keras.layers.BatchNormalization(momentum=0.9)
    return keras.Sequential(
        [keras.Input((6,)), first, keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    )


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_deferred_batch_norm_moving_statistics_equal_the_unsplit_models(schedule, nested):
    # BatchNorm first: its input is the data, so its statistics do not depend on the
    # weights (which per-micro-batch normalisation trains slightly differently).
    rng = np.random.RandomState(0)
    x, y = (rng.randn(64, 6) * 3 + 2).astype("float32"), rng.randn(64, 1).astype("float32")

    def moving_statistics(model):
        model.compile(optimizer="sgd", loss="mse")
        model.fit(x, y, batch_size=16, epochs=4, shuffle=False, verbose=0)  # 16 steps
        layer = getattr(model, "unsplit_model", model).layers[0]
        return [np.asarray(v) for v in layer.weights[2:]]  # moving mean and variance

    expected = moving_statistics(_normalised_mlp(nested))
    options = {"num_stages": 2, "num_microbatches": 4, "schedule": schedule, "microbatch_statistics": True}
    deferred = moving_statistics(PipelineStrategy(**options).split(_normalised_mlp(nested)))
    for got, want in zip(deferred, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    per_microbatch = PipelineStrategy(**options, deferred_batch_norm=False).split(_normalised_mlp(nested))
    assert np.max(np.abs(moving_statistics(per_microbatch)[1] - expected[1])) > 0.1
