"""Keras 3 `fit` / `evaluate` / `predict` under `tf.distribute.MultiWorkerMirroredStrategy`.

Keras 3 (3.0 to at least 3.15.1, TensorFlow backend) crashes before the first
step of a multi-worker `fit`. Upstream: keras-team/keras#20585 and
tensorflow/tensorflow#72388 (open). Two private functions of
`keras.src.backend.tensorflow.trainer` are at fault, and this module replaces
exactly those two, only on Keras versions that have them unfixed:

1. `TensorFlowTrainer._maybe_symbolic_build` reduces the first *data batch*
   across workers with `strategy.reduce("MEAN", batch)` just to learn its
   shapes. Under MWMS that is a cross-worker collective on input data, which
   fails ("Attempt to convert a value (PerReplica...)"). The same reduce also
   breaks plain `MirroredStrategy` whenever the global batch does not split
   evenly over the replicas (16 over 3: "Inputs to operation AddN ... must have
   the same size"). Fix: build from this worker's first local replica batch
   (only shapes and dtypes are used).
2. `reduce_per_replica(..., "mean")` reduces per-replica logs (scalars) with
   `strategy.reduce("MEAN", v, axis=0)` under MWMS ("Invalid reduction
   dimension 0 for input with 0 dimensions"). Fix: scalars are reduced with
   `axis=None`, i.e. averaged across every replica of every worker, as
   `MirroredStrategy` does for its local replicas.

Users who build `tf.distribute.MultiWorkerMirroredStrategy` themselves call
`tfscale.compat.apply_multi_worker_fixes()` once before `model.fit`;
`tfscale.strategies.get` applies it for "mirrored" and "multi_worker" (and "auto"
when it picks one of them).
"""

import functools

import keras
import tensorflow as tf

__all__ = ["apply", "is_applied", "make_multi_worker_strategy", "needed"]

# First Keras release with keras-team/keras#20585 fixed; None while it is open.
# When upstream ships the fix, set it here and `apply()` becomes a no-op there.
_FIXED_IN = None
_state = {"applied": False}


def _version_tuple(version):
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:3])


def needed(version=None):
    """True when this Keras version has the multi-worker bugs unfixed."""
    version = _version_tuple(version or keras.__version__)
    if version < (3,):
        return False  # Keras 2 (tf_keras) has its own multi-worker path.
    return _FIXED_IN is None or version < _version_tuple(_FIXED_IN)


def is_applied():
    """True once `apply()` has patched this process's Keras."""
    return _state["applied"]


def _trainer_module():
    from keras.src.backend.tensorflow import trainer

    return trainer


def _local_batch(value):
    if isinstance(value, tf.distribute.DistributedValues):
        return value.values[0]
    return value


def _make_symbolic_build(trainer):
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        if self._distribute_strategy is None:
            return
        if iterator is not None:
            for _, _, it in iterator:
                # Shapes and dtypes are all `_symbolic_build` reads: take this
                # worker's first replica batch instead of a cross-worker reduce.
                data_batch = tf.nest.map_structure(_local_batch, next(it))
                break
        with self.distribute_strategy.scope():
            self._symbolic_build(data_batch=data_batch)

    return _maybe_symbolic_build


def _make_reduce_per_replica(original):
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        trainer = _trainer_module()
        if reduction in ("auto", "mean") and trainer._collective_all_reduce_multi_worker(strategy):

            def _mean(v):
                local = strategy.experimental_local_results(v)[0]
                axis = None if local.shape.rank == 0 else 0
                return strategy.reduce("MEAN", v, axis=axis)

            return tf.nest.map_structure(_mean, values)
        return original(values, strategy, reduction)

    return reduce_per_replica


def apply():
    """Patches Keras 3 so `fit`/`evaluate`/`predict` work under MWMS.

    Idempotent. Does nothing on Keras versions where upstream is fixed.

    Returns:
        True if the fixes are in effect after the call, False if not needed.
    """
    if _state["applied"]:
        return True
    if not needed():
        return False
    trainer = _trainer_module()
    trainer.TensorFlowTrainer._maybe_symbolic_build = _make_symbolic_build(trainer)
    trainer.reduce_per_replica = _make_reduce_per_replica(trainer.reduce_per_replica)
    _state["applied"] = True
    return True


def make_multi_worker_strategy(cluster_resolver=None, communication_options=None, cpu_replicas=None):
    """Builds `tf.distribute.MultiWorkerMirroredStrategy`, optionally over N logical CPUs per worker.

    MWMS places one replica per worker on CPU (it counts only GPUs/TPUs as
    local devices). With `cpu_replicas=N > 1` each worker replicates over its
    first N logical CPU devices instead, so a CPU-only cluster has the same
    worker x replica topology as N GPUs per host.
    """
    if not cpu_replicas or cpu_replicas == 1:
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=cluster_resolver, communication_options=communication_options
        )
    return _make_cpu_replicated(cluster_resolver, communication_options, cpu_replicas)


def _make_cpu_replicated(cluster_resolver, communication_options, cpu_replicas):
    from tensorflow.python.distribute import collective_all_reduce_strategy as cars

    extended_cls = cars.CollectiveAllReduceExtended
    original = extended_cls._initialize_local_devices

    def _initialize_local_devices(self, resolver, worker_device):
        devices, device_type = original(self, resolver, worker_device)
        if device_type != "CPU":
            return devices, device_type
        return tuple(f"{worker_device}/device:CPU:{i}" for i in range(cpu_replicas)), "CPU"

    # Swapped only for the duration of this one constructor call.
    extended_cls._initialize_local_devices = _initialize_local_devices
    try:
        return tf.distribute.MultiWorkerMirroredStrategy(
            cluster_resolver=cluster_resolver, communication_options=communication_options
        )
    finally:
        extended_cls._initialize_local_devices = original
