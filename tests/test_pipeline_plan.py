"""`PipelinedModel.plan_report`: memory per device and bytes per step against hand-computed values.

The model: Dense 6 -> 12 -> 10 -> 8 -> 3 (float32, Adam), cut uniformly into 2 stages,
2 data-parallel replicas on 4 logical CPUs, M = 2, a global batch of 16 (micro-batch 4).
"""

import json

import keras
import numpy as np

from tfscale.strategies import PipelineStrategy

# Stage 0: Dense(6->12) + Dense(12->10) = 84 + 130 params; stage 1: Dense(10->8) + Dense(8->3) = 88 + 27.
STAGE_PARAM_BYTES = [4 * (84 + 130), 4 * (88 + 27)]  # 856, 460
BOUNDARY_BYTES = 4 * 10 * 4  # one micro-batch (4 samples) of stage 0's 10-wide output
S, M, D = 2, 2, 2


def _pipelined(schedule):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,)), *(keras.layers.Dense(n, name=f"d{i}") for i, n in enumerate((12, 10, 8, 3)))],
        name="plan_mlp",
    )
    strategy = PipelineStrategy(
        num_stages=S, num_microbatches=M, data_parallel=D, schedule=schedule, balance="uniform"
    )
    pipelined = strategy.split(model)
    pipelined.compile(optimizer="adam", loss="mse")
    return pipelined


def test_plan_report_matches_the_hand_computed_bytes_and_changes_no_weight():
    pipelined = _pipelined("gpipe")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(16, 6)).astype("float32"), rng.normal(size=(16, 3)).astype("float32")
    before = [v.numpy() for v in pipelined.variables]
    report = pipelined.plan_report(x, y)
    for a, v in zip(before, pipelined.variables, strict=True):
        np.testing.assert_array_equal(a, v.numpy())
    assert [d.device for d in report.devices] == [f"/device:CPU:{i}" for i in range(4)]
    assert [d.param_bytes for d in report.devices] == STAGE_PARAM_BYTES * D
    assert [d.slot_bytes for d in report.devices] == [2 * b for b in STAGE_PARAM_BYTES] * D  # Adam: m, v
    assert [d.layers for d in report.devices] == [["d0", "d1"], ["d2", "d3"]] * D
    # GPipe keeps all M micro-batches on every device: stage 0 keeps 4x12 + 4x10 floats each,
    # stage 1 keeps 4x8 + 4x3 (measured live count x micro-batch outputs).
    assert [d.activation_bytes for d in report.devices] == [
        M * 4 * (4 * 12 + 4 * 10),
        M * 4 * (4 * 8 + 4 * 3),
    ] * D
    assert report.boundary_bytes == [BOUNDARY_BYTES]
    assert report.activation_bytes_formula == 2 * (S - 1) * BOUNDARY_BYTES * M * D == 1280
    assert report.gradient_bytes_formula == D * (D - 1) * sum(STAGE_PARAM_BYTES) == 2632
    assert abs(report.activation_bytes_measured - 1280) <= 0.1 * 1280
    assert abs(report.gradient_bytes_measured - 2632) <= 0.1 * 2632
    assert report.max_device_bytes == 856 + 2 * 856 + 2 * 4 * 88
    assert json.loads(report.to_json())["max_device_bytes"] == report.max_device_bytes
    assert "activations 1280 B measured" in report.table()
