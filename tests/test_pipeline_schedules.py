"""Interleaved 1F1B, ZB-H1 and ZB-V: their arithmetic, same training as one device, W in the trace.

A schedule is checked twice: its arithmetic by simulation with fixed op times
(`schedules.simulate`: every op once, no deadlock, the bubble equal to the registered
theory, the live activations equal to the registered bound), and the real thing on logical
CPU devices (losses and weights equal to the unsplit model to the tolerances of
`test_pipeline.py`; live activations and the W ops measured from a profiled step).
"""

import collections

import matplotlib.colors
import matplotlib.image
import numpy as np
import pytest
import tensorflow as tf
from test_pipeline import ATOL, RTOL, _compile, _data, _fit, _reference, _wrap

import tfscale.strategies
from tfscale.compat import tf_xplane
from tfscale.strategies import PipelineStrategy, StrategyError
from tfscale.strategies.pipeline import schedules
from tfscale.strategies.pipeline import timeline as _timeline
from tfscale.strategies.pipeline.schedules import Kind, Op

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_new_schedules_train_like_unsplit_model": 2,
    "test_live_activations_within_the_bound_in_a_measured_run": 1,
}


_NEW = [("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]
_LAYERS = {"mlp": 4, "cnn": 6}


@pytest.mark.parametrize(
    ("schedule", "virtual_stages"),
    [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1), ("zb-v", 2)],
)
@pytest.mark.parametrize(("num_stages", "num_microbatches"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_simulated_schedule_has_its_registered_bubble_and_activation_bound(
    schedule, virtual_stages, num_stages, num_microbatches
):
    s, m, v = num_stages, num_microbatches, virtual_stages
    orders = schedules.order(schedule, s, m, v)
    split = schedules.registered(schedule).constraints.weight_ops
    kinds = [Kind.FORWARD, Kind.BACKWARD] + ([Kind.WEIGHT] if split else [])
    ops = [op for lane in orders for op in lane]
    assert sorted(ops) == sorted(Op(c, k, i) for c in range(s * v) for k in kinds for i in range(m))
    assert all(
        schedules.chunk_device(op.stage, s, schedule) == d for d, lane in enumerate(orders) for op in lane
    )
    # Equal op times: F = B = W for zero bubble; otherwise the backward is twice a forward,
    # and a chunk does 1/V of its device's work.
    costs = {Kind.FORWARD: 1 / v, Kind.BACKWARD: 2 / v, Kind.WEIGHT: 0.0}
    if split:
        costs = dict.fromkeys(Kind, 1.0)
    intervals = schedules.simulate(orders, costs, v)
    spans = [(schedules.chunk_device(op.stage, s, schedule), a, b) for op, (a, b) in intervals.items()]
    assert schedules.bubble_fraction(spans, s) == pytest.approx(
        schedules.theoretical_bubble(s, m, schedule, v)
    )
    assert schedules.live_activations(intervals, s, schedule) == schedules.activation_bound(schedule, s, m, v)


def test_simulated_zb_h1_bubble_is_a_third_of_1f1b_and_deadlocks_are_reported():
    flush = schedules.theoretical_bubble(2, 8, "1f1b")
    assert schedules.theoretical_bubble(2, 8, "zb-h1") == pytest.approx(1 / 25)
    assert 1 / 25 < flush / 2
    assert schedules.theoretical_bubble(2, 8, "interleaved", 2) == pytest.approx(1 / 17)
    assert schedules.activation_bound("zb-h1", 4, 8) == [4, 4, 4, 4]
    assert schedules.activation_bound("interleaved", 2, 8, 2) == [5, 3]
    # One slow op (its own time, as measured in a trace) delays what depends on it and
    # opens idle time the kind's mean cost does not show.
    orders = schedules.order("1f1b", 2, 2)
    even = schedules.simulate(orders, dict.fromkeys(Kind, 1.0))
    slow = schedules.simulate(orders, {**dict.fromkeys(Kind, 1.0), Op(0, Kind.FORWARD, 0): 3.0})
    assert slow[Op(0, Kind.FORWARD, 0)] == (0.0, 3.0)
    assert slow[Op(1, Kind.FORWARD, 0)] == (3.0, 4.0)
    assert max(b for _, b in slow.values()) == max(b for _, b in even.values()) + 2.0
    backwards_first = [list(reversed(lane)) for lane in schedules.order("1f1b", 2, 2)]
    with pytest.raises(StrategyError, match="deadlocks"):
        schedules.simulate(backwards_first, dict.fromkeys(Kind, 1.0))


def _kind_for(kind, schedule, num_stages, virtual_stages):
    # S x V chunks need as many layers: the 8-layer variants of the same models.
    return kind + "8" if num_stages * virtual_stages > _LAYERS[kind] else kind


# Fast tier: every schedule on every MLP shape and on the smallest CNN; the full run adds
# the other CNN shapes (the same schedule code, 3-12 s each).
_SHAPES = [
    pytest.param(kind, stages, micro, id=f"{kind}-{stages}-{micro}", marks=() if fast else pytest.mark.slow)
    for kind in ("mlp", "cnn")
    for stages in (2, 4)
    for micro in (4, 8)
    for fast in [kind == "mlp" or (stages, micro) == (2, 4)]
]


@pytest.mark.parametrize(("schedule", "virtual_stages"), _NEW, ids=["interleaved-v2", "zb-h1", "zb-v"])
@pytest.mark.parametrize(("kind", "num_stages", "num_microbatches"), _SHAPES)
def test_new_schedules_train_like_unsplit_model(kind, num_stages, num_microbatches, schedule, virtual_stages):
    kind = _kind_for(kind, schedule, num_stages, virtual_stages)
    history, weights = _reference(kind)
    pipelined = _compile(
        _wrap(
            kind,
            num_stages=num_stages,
            num_microbatches=num_microbatches,
            schedule=schedule,
            virtual_stages=virtual_stages,
        )
    )
    assert len(pipelined.stages) == num_stages * virtual_stages
    got = _fit(pipelined, *_data(kind))
    np.testing.assert_allclose(got["loss"], history["loss"], rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got["mae"], history["mae"], rtol=RTOL, atol=ATOL)
    for a, b in zip(pipelined.get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def test_zb_h1_trains_like_unsplit_model_when_run_eagerly():
    history, weights = _reference("mlp")
    pipelined = _compile(_wrap("mlp", num_stages=2, num_microbatches=2, schedule="zb-h1"), run_eagerly=True)
    got = _fit(pipelined, *_data("mlp"))
    np.testing.assert_allclose(got["loss"], history["loss"], rtol=RTOL, atol=ATOL)
    for a, b in zip(pipelined.get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL)


def _chart_pixels(png, colour):
    """Pixels of `colour` in the chart's boxes: the left 80%, clear of the legend on the right."""
    pixels = matplotlib.image.imread(png)[..., :3]
    chart = pixels[:, : int(pixels.shape[1] * 0.8)]
    return int(np.sum(np.all(np.abs(chart - matplotlib.colors.to_rgb(colour)) < 2 / 255, axis=-1)))


@pytest.mark.parametrize(
    ("schedule", "virtual_stages", "num_stages", "serialize_stages"),
    [
        ("zb-h1", 1, 4, None),
        ("zb-h1", 1, 4, False),
        ("interleaved", 2, 2, None),
        ("interleaved", 2, 2, False),
        ("zb-v", 2, 2, None),
        ("zb-v", 2, 2, False),
    ],
)
def test_live_activations_within_the_bound_in_a_measured_run(
    schedule, virtual_stages, num_stages, serialize_stages, tmp_path
):
    # 8 layers: every chunk has 2, so every B has an input gradient to compute.
    pipelined = _compile(
        _wrap(
            "mlp8",
            num_stages=num_stages,
            num_microbatches=8,
            schedule=schedule,
            virtual_stages=virtual_stages,
            serialize_stages=serialize_stages,
        )
    )
    trace = pipelined.trace_step(*_data("mlp8"))
    orders = schedules.order(schedule, num_stages, 8, virtual_stages)
    assert set(trace.intervals) == {op for lane in orders for op in lane}
    bound = schedules.activation_bound(schedule, num_stages, 8, virtual_stages)
    assert trace.activation_bound == bound
    if serialize_stages is None:
        # Each device runs the schedule's order exactly: the bound is reached, not passed.
        assert trace.live_activations == bound, trace.live_activations
    else:
        assert all(live <= b for live, b in zip(trace.live_activations, bound)), trace.live_activations
    split = schedules.registered(schedule).constraints.weight_ops
    if split and serialize_stages is None:
        for op, (start, _) in trace.intervals.items():
            if op.kind == Kind.WEIGHT:
                assert start >= trace.intervals[Op(op.stage, Kind.BACKWARD, op.microbatch)][1]
    png = _timeline.plot(trace, tmp_path / "timeline.png")
    forward, backward, weight = (_chart_pixels(png, kind.colour) for kind in Kind)
    assert forward > 0 and backward > 0
    assert weight > 0 if split else weight == 0


def _contractions_by_kind(pipelined, x, y, logdir):
    pipelined.train_on_batch(x, y)
    tf.profiler.experimental.start(str(logdir))
    pipelined.train_on_batch(x, y)
    tf.profiler.experimental.stop()
    counts = collections.Counter()
    for name, _, _ in tf_xplane.op_events(str(logdir)):
        op = schedules.parse_op_name(name)
        if op is not None and "MatMul" in name.rpartition(":")[2]:  # _MklMatMul, _FusedMatMul, ...
            counts[Kind(op.kind)] += 1
    return counts


def test_zb_h1_backward_computes_input_gradients_and_w_the_weight_gradients(tmp_path):
    """MLP 2 | 2 Dense layers, M=2: per micro-batch 4 forward, 3 input-gradient (the first
    layer's input needs none) and 4 weight-gradient products; 1F1B's B does both (7)."""
    x, y = _data("mlp")
    zb = _compile(_wrap("mlp", num_stages=2, num_microbatches=2, schedule="zb-h1"))
    split = _contractions_by_kind(zb, x, y, tmp_path / "zb")
    assert split == {Kind.FORWARD: 8, Kind.BACKWARD: 6, Kind.WEIGHT: 8}, split
    joint = _contractions_by_kind(
        _compile(_wrap("mlp", num_stages=2, num_microbatches=2)), x, y, tmp_path / "1f1b"
    )
    assert joint == {Kind.FORWARD: 8, Kind.BACKWARD: 14}, joint


def test_interleaved_puts_chunk_c_on_device_c_mod_s():
    pipelined = _wrap("mlp", num_stages=2, num_microbatches=4, schedule="interleaved", virtual_stages=2)
    devices = tfscale.strategies.split_cpu(2)
    assert [stage.device for stage in pipelined.stages] == devices * 2
    assert [part["device"] for part in pipelined.partition] == devices * 2
    assert pipelined.virtual_stages == 2


def test_zb_v_puts_chunks_d_and_2s_minus_1_minus_d_on_device_d():
    # The V: the chain goes down the devices and back up, so device 0 holds the first
    # chunk and the last (the loss), and each device's two chunks meet at the bottom.
    assert schedules.stage_devices(["a", "b"], 4, "zb-v") == ["a", "b", "b", "a"]
    assert schedules.stage_devices(list("abcd"), 8, "zb-v") == list("abcddcba")
    pipelined = _wrap("mlp", num_stages=2, num_microbatches=4, schedule="zb-v", virtual_stages=2)
    devices = tfscale.strategies.split_cpu(2)
    assert [stage.device for stage in pipelined.stages] == devices + devices[::-1]
    assert [part["device"] for part in pipelined.partition] == devices + devices[::-1]
    for stage in pipelined.stages:
        for variable in stage.trainable_variables:
            assert variable.value.device.endswith(stage.device.split("/")[-1]), (variable.path, stage.device)


def test_zb_v_bubble_and_activations_against_the_other_schedules():
    # Equal op times (a chunk op is half a stage op): half ZB-H1's idle time at 1F1B's
    # activation memory (2S chunk micro-batches = S stage micro-batches).
    for s, m in [(2, 4), (2, 8), (4, 8)]:
        assert schedules.theoretical_bubble(s, m, "zb-v", 2) == pytest.approx((s - 1) / (6 * m + s - 1))
        assert schedules.theoretical_bubble(s, m, "zb-v", 2) < schedules.theoretical_bubble(s, m, "zb-h1")
        assert schedules.activation_bound("zb-v", s, m, 2) == [2 * s] * s
    assert schedules.theoretical_bubble(2, 8, "zb-v", 2) == pytest.approx(1 / 49)
    assert schedules.theoretical_bubble(4, 4, "zb-v", 2) == pytest.approx(1 / 5)  # 2M < 3S - 1
    assert schedules.activation_bound("zb-v", 4, 4, 2) == [5, 6, 7, 8]
    # Device d's order: forwards down the V first, its first B on its second chunk.
    assert schedules.order("zb-v", 2, 4, 2)[1][:6] == [
        Op(1, Kind.FORWARD, 0),
        Op(2, Kind.FORWARD, 0),
        Op(1, Kind.FORWARD, 1),
        Op(2, Kind.FORWARD, 1),
        Op(2, Kind.BACKWARD, 0),
        Op(2, Kind.WEIGHT, 0),
    ]


def test_bad_schedule_options_raise_clear_errors():
    with pytest.raises(
        StrategyError, match=r"`virtual_stages`.*virtual_stages=2 with schedule='1f1b'.*'interleaved'"
    ):
        PipelineStrategy(num_stages=2, schedule="1f1b", virtual_stages=2)
    with pytest.raises(StrategyError, match=r"`virtual_stages`.*virtual_stages=0"):
        PipelineStrategy(num_stages=2, schedule="interleaved", virtual_stages=0)
    with pytest.raises(
        StrategyError, match=r"num_microbatches=6 with schedule='interleaved' and num_stages=4"
    ):
        PipelineStrategy(num_stages=4, num_microbatches=6, schedule="interleaved", virtual_stages=2)
    with pytest.raises(StrategyError, match=r"`recompute`.*schedule='zb-h1'"):
        PipelineStrategy(num_stages=2, schedule="zb-h1", recompute=True)
    with pytest.raises(
        StrategyError, match=r"`virtual_stages`.*virtual_stages=1 with schedule='zb-v'.*Expected 2"
    ):
        PipelineStrategy(num_stages=2, schedule="zb-v")
    with pytest.raises(
        StrategyError, match=r"`virtual_stages`.*virtual_stages=3 with schedule='zb-v'.*Expected 2"
    ):
        PipelineStrategy(num_stages=2, schedule="zb-v", virtual_stages=3)
    with pytest.raises(StrategyError, match=r"`recompute`.*schedule='zb-v'"):
        PipelineStrategy(num_stages=2, schedule="zb-v", virtual_stages=2, recompute=True)
