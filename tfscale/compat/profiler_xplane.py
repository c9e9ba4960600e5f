"""Reading TensorFlow profiler traces (`*.xplane.pb`) for collective launches.

`tf.profiler.experimental.start/stop` writes an XSpace protobuf per host; TensorFlow
has no public reader for it (TensorBoard's profile plugin converts it in C++). Its
message classes live at `tensorflow.tsl.profiler.protobuf.xplane_pb2`, a private
module path (TF 2.16 to 2.21 checked; it was `tensorflow.tsl...` throughout that
range), and the collective executor marks every launch with an event named
"<op name>:CollectiveReduceV2" carrying `group_key`/`instance_key` stats (the
format TF 2.21 writes). tests/test_compat_profiler_xplane.py fails if either moves.
"""

import dataclasses
import glob
import os

__all__ = ["CollectiveEvent", "TraceEvent", "available", "collective_events", "latest_trace", "trace_events"]

_COLLECTIVE_SUFFIX = ":CollectiveReduceV2"


@dataclasses.dataclass(frozen=True)
class CollectiveEvent:
    """One collective launch on one device: which all-reduce and how long it ran."""

    name: str
    instance_key: int
    group_key: int
    duration_s: float


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One event of the trace: the thread ("line") it ran on, its name, start and end (ns)."""

    line: str
    name: str
    start_ns: float
    end_ns: float


def _xplane_pb2():
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    return xplane_pb2


def available():
    """True when this TensorFlow has the XSpace protobuf where this module reads it."""
    try:
        _xplane_pb2()
    except ImportError:
        return False
    return True


def latest_trace(logdir):
    """The newest `*.xplane.pb` written under `logdir` by the profiler, or None."""
    paths = glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))
    return max(paths, key=os.path.getmtime) if paths else None


def _stat_value(stat):
    for field in ("int64_value", "uint64_value", "double_value", "str_value"):
        if stat.HasField(field):
            return getattr(stat, field)
    return None


def _space(path):
    """The XSpace protobuf in the file at `path`."""
    space = _xplane_pb2().XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    return space


def collective_events(path):
    """Every `CollectiveReduceV2` launch recorded in the trace at `path`."""
    space = _space(path)
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if not name.endswith(_COLLECTIVE_SUFFIX):
                    continue
                stats = {plane.stat_metadata[s.metadata_id].name: _stat_value(s) for s in event.stats}
                events.append(
                    CollectiveEvent(
                        name=name[: -len(_COLLECTIVE_SUFFIX)],
                        instance_key=int(stats.get("instance_key", -1)),
                        group_key=int(stats.get("group_key", -1)),
                        duration_s=event.duration_ps * 1e-12,
                    )
                )
    return events


def trace_events(path):
    """Every event of every thread in the trace at `path`, in the profiler's clock (ns)."""
    space = _space(path)
    events = []
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                start_ns = line.timestamp_ns + event.offset_ps / 1000.0
                events.append(
                    TraceEvent(
                        line=line.name,
                        name=plane.event_metadata[event.metadata_id].name,
                        start_ns=start_ns,
                        end_ns=start_ns + event.duration_ps / 1000.0,
                    )
                )
    return events
