"""tfscale.compat.profiler_xplane: collective launches counted from a real profiler trace.

Also the run-time proof that gradient accumulation communicates once per k micro-steps.
"""

import _optimizer_workers as workers
import pytest
import tensorflow as tf

from tfscale.compat import profiler_xplane
from tfscale.strategies import get


def _profiled_launches(tmp_path, options, steps=8):
    """All-reduce launches per replica while `fit` runs `steps` micro-steps under the profiler."""
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
    return len(events) / strategy.num_replicas_in_sync


def test_the_private_reader_still_finds_tensorflows_protobuf():
    assert profiler_xplane.available()


def test_accumulation_launches_once_per_k_micro_steps(tmp_path):
    every_step = _profiled_launches(tmp_path / "k1", {})
    every_fourth = _profiled_launches(tmp_path / "k4", {"gradient_accumulation_steps": 4})
    assert every_step == 8  # One pack per step (bytes_per_pack=0).
    assert every_fourth == pytest.approx(every_step / 4)
