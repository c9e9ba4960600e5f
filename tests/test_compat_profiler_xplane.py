"""tfscale.compat.profiler_xplane: collective launches counted from a real profiler trace.

Also the run-time proof that gradient accumulation communicates once per k micro-steps.
"""

import _optimizer_workers as workers
import numpy as np
import pytest
import tensorflow as tf

from tfscale.compat import keras_loss_denominator, profiler_xplane
from tfscale.strategies import get


def _profiled_launches(tmp_path, options, steps=8):
    """(gradient, loss) all-reduce launches per replica while `fit` runs `steps` micro-steps
    under the profiler (the loss's: its sum and denominator, `keras_loss_denominator`)."""
    x, y = workers.data(steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(workers.GLOBAL_BATCH)
    strategy = get("mirrored", cpu_replicas=2)
    with strategy.scope():
        model = workers.build_model(options)
    model.fit(dataset, verbose=0)  # Traced and warmed up outside the profile.
    tf.profiler.experimental.start(str(tmp_path))
    try:
        model.fit(dataset, verbose=0)
    finally:
        tf.profiler.experimental.stop()
    events = profiler_xplane.collective_events(profiler_xplane.latest_trace(str(tmp_path)))
    assert all(e.duration_s > 0 and e.instance_key >= 0 for e in events)
    loss = sum(keras_loss_denominator.NAME_SCOPE in e.name.split("/") for e in events)
    replicas = strategy.num_replicas_in_sync
    return (len(events) - loss) / replicas, loss / replicas


def test_the_private_reader_still_finds_tensorflows_protobuf():
    assert profiler_xplane.available()


@pytest.mark.slow  # 26 s; fast tier: the step-time breakdown test here
def test_accumulation_launches_once_per_k_micro_steps(tmp_path):
    every_step = _profiled_launches(tmp_path / "k1", {})
    every_fourth = _profiled_launches(tmp_path / "k4", {"gradient_accumulation_steps": 4})
    assert every_step == (8, 8)  # One gradient pack per step (bytes_per_pack=0), one loss launch.
    assert every_fourth == (pytest.approx(every_step[0] / 4), 8)  # The loss's: every micro-step.


def _profile_fit(log_dir, options, profile_steps=(3, 6)):
    import tfscale.callbacks

    x, y = workers.data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(workers.GLOBAL_BATCH)
    strategy = get("mirrored", cpu_replicas=2)
    with strategy.scope():
        model = workers.build_model(options)
    profiler = tfscale.callbacks.CommunicationProfiler(str(log_dir), profile_steps=profile_steps)
    model.fit(dataset, verbose=0, callbacks=[profiler])
    return profiler.report


@pytest.mark.parametrize(("options", "launches"), [({}, 1.0), ({"gradient_accumulation_steps": 2}, 0.5)])
def test_communication_profiler_reports_launches_and_fraction(tmp_path, options, launches):
    import gzip
    import json

    report = _profile_fit(tmp_path, options)
    # The gradients' launches, and the loss's one every step (`keras_loss_denominator`).
    assert report["allreduce_launches_per_step"] == launches + 1
    assert 0 < report["allreduce_fraction"] < 1
    assert report["profiled_steps"] == [3, 6]
    # The test model's 178 float32 parameters, all-reduced once per k micro-steps.
    assert report["allreduce_bytes_per_step"] == 712 * launches
    with open(tmp_path / "communication-local.json") as f:
        assert json.load(f) == report
    with gzip.open(tmp_path / "trace-local.json.gz", "rt") as f:
        names = {e["name"] for e in json.load(f)["traceEvents"]}
    assert any(n.endswith(":CollectiveReduceV2") for n in names)
    assert (tmp_path / "communication.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("profile_steps", [(0, 2), (3, 2), (1,), "1:2", (1.0, 2)])
def test_communication_profiler_bad_steps(profile_steps):
    import tfscale.callbacks

    with pytest.raises(ValueError, match="profile_steps="):
        tfscale.callbacks.CommunicationProfiler("/tmp/unused", profile_steps=profile_steps)


def test_input_compute_and_allreduce_add_up_to_the_measured_step_time(tmp_path):
    import keras

    import tfscale.callbacks

    # Wide enough that Keras's own loop between steps (outside the step events, inside
    # the wall clock) is small next to a step.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256 * 12, 32)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, (x[:, 0] > 0).astype("int32"))).batch(256)
    strategy = get("mirrored", cpu_replicas=2)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(512, activation="relu"),
                keras.layers.Dense(512),
                keras.layers.Dense(2),
            ]
        )
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    profiler = tfscale.callbacks.CommunicationProfiler(str(tmp_path), profile_steps=(3, 10))
    model.fit(dataset, verbose=0, callbacks=[profiler])
    report = profiler.report
    assert len(report["steps"]) == 8
    for step in report["steps"]:
        assert step["input_s"] >= 0 and step["allreduce_s"] > 0, step
        assert step["compute_s"] > step["host_s"] >= 0, step
    # All-reduce takes priority over input: a step whose get_next ran wholly inside another
    # replica's all-reduce counts no input (CI, under load: one step of 8 read input_s 0.0).
    assert sum(step["input_s"] for step in report["steps"]) > 0
    # step_s is the wall clock around the profiled steps, measured apart from the trace: it
    # also holds Keras's loop between steps, which grows when another process shares the
    # cores (under `pytest -n 2` it reached 12% of a step: 0.00907 s traced, 0.01036 s wall).
    # The traced parts fit inside it and cover at least 3/4 of it.
    parts = sum(report[f"{kind}_s_per_step"] for kind in ("input", "compute", "allreduce"))
    assert 0.75 * report["step_s"] <= parts <= 1.02 * report["step_s"]
