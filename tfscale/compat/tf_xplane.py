"""Reading the op events of a TensorFlow profiler trace (`.xplane.pb`).

Upstream gap: `tf.profiler.experimental` writes a trace but offers no public reader of
it; the protobuf class TensorFlow ships for it lives at a private module path,
`tensorflow.tsl.profiler.protobuf.xplane_pb2`. The pipeline timeline reads each op's
name, start and duration from it.

Checked on TensorFlow 2.21 (the path exists in TF 2.16-2.21).
Gate: `available()`; `tests/test_compat_strategies.py` profiles a named op and fails when
its event can no longer be read back.
"""

import glob
import os

__all__ = ["available", "op_events"]


def available():
    """True when this TensorFlow ships the XPlane protobuf at the known path."""
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: F401
    except ImportError:
        return False
    return True


def op_events(logdir):
    """Yields (name, start_ns, end_ns) of every event in the traces under `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    for path in paths:
        space = xplane_pb2.XSpace()
        with open(path, "rb") as f:
            space.ParseFromString(f.read())
        for plane in space.planes:
            names = plane.event_metadata
            for line in plane.lines:
                for event in line.events:
                    start_ns = line.timestamp_ns + event.offset_ps / 1000.0
                    yield names[event.metadata_id].name, start_ns, start_ns + event.duration_ps / 1000.0
