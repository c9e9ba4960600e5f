"""TensorFlow bug: stopping the profiler on a non-leader `multi_worker` task corrupts the heap.

`tf.profiler.experimental.stop()` collects the host trace in TSL's
`TraceMeRecorder::Consume` (xla/tsl/profiler/backends/cpu/traceme_recorder.cc). An
activity started on one thread and ended on another (`TraceMe::ActivityStart` /
`ActivityEnd`) is recorded as two halves; Consume walks the threads' queues, keeps a
pointer to each end half whose start it has not seen yet (a `std::deque` element), and
moves each thread's deque into a `std::vector<ThreadEvents>` that it does not reserve.
libstdc++'s deque has no noexcept move constructor, so when that vector grows it COPIES
the deques and frees the old ones; `HandleCrossThreadEvents` then writes through the
kept pointers into freed memory (`SplitEventTracker::FindStartAndMerge`): `free():
invalid pointer` or SIGSEGV, or silent heap corruption. The installed TF 2.21 binary
shows it: `libtensorflow_framework.so.2` instantiates
`std::vector<ThreadEvents>::_M_realloc_insert` with `__uninit_copy` of ThreadEvents and
the deque copy constructor, and has no `TraceMeRecorder::Flush` (the later upstream
version that reserves the vector and keeps one tracker under a mutex).

Which activities are split: `BaseCollectiveExecutor::CompleteParamsAsync`
(tensorflow/core/common_runtime/base_collective_executor.cc) starts
"CollectiveExecutor::CompleteParams" (level 1, so no `host_tracer_level` skips it) on the
collective thread and ends it in the param resolver's callback. On the collective group
leader (the chief, or worker 0 without a chief: `multi_worker_util.collective_leader`)
the resolution is local and the callback runs on the same thread; on every other worker
`CollectiveParamResolverDistributed` asks the leader by RPC for each launch, and the
callback runs on a gRPC thread (`tf_GrpcWorkerEnvQueues`). Traces of the 2-worker
`--profile_steps=4:6` job: worker 1 had 12 of 12 CompleteParams ended on a gRPC thread,
worker 0 none. Whether Consume then crashes depends on the order of its per-thread
recorders (an `absl::flat_hash_map` keyed by pointer: random per process), so about one
run in ten crashed on worker 1, and only there. No barrier, sleep or tf.data setting
changes that: the split halves come from the all-reduce the profiler is there to measure.

So on an affected TensorFlow only the leader may trace under `multi_worker`. No upstream
issue tracks the crash as of TF 2.21. Checked on TF 2.21 (binary and source); the
upstream main branch reserves the vector. Gate: `every_worker_can_trace()`, False on every
version until a fixed release is checked and listed in `FIXED_IN`.
tests/test_compat.py checks the gate; tests/test_train.py's 2-worker `--profile_steps`
job checks that the leader traces and the other worker only times its steps.
"""

import tensorflow as tf

__all__ = ["CHECKED_ON", "FIXED_IN", "every_worker_can_trace", "may_trace"]

CHECKED_ON = ("2.21",)
# First TensorFlow release whose TraceMeRecorder::Consume reserves its result (none checked yet).
FIXED_IN = None


def _version(text):
    return tuple(int(p) for p in text.split(".")[:2])


def every_worker_can_trace(version=None):
    """The gate: True when every worker of a `multi_worker` job may stop the profiler safely."""
    if FIXED_IN is None:
        return False
    return _version(version or tf.version.VERSION) >= _version(FIXED_IN)


def may_trace(*, multi_worker, collective_leader, version=None):
    """Whether this task may run TensorFlow's profiler: yes, unless a non-leader worker on an affected TF."""
    return not multi_worker or collective_leader or every_worker_can_trace(version)
