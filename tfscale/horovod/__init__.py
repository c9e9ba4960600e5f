"""tfscale.horovod: Horovod's `horovod.tensorflow(.keras)` API on TensorFlow 2.16+ and Keras 3.

    import tfscale.horovod as hvd          # was: import horovod.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

and `tfscale-launch -np 2 python train.py` for `horovodrun -np 2 python train.py`.
Each process is one rank with its own model and its own `fit`; ranks exchange tensors
only through these calls, on TensorFlow's own cross-worker collectives (those of
`tfscale.strategies.get("multi_worker")`), eagerly and inside `tf.function`.

Layout: `_basics` (init and identity, from `tfscale.cluster.ClusterSpec`),
`_collective` (allreduce, allgather, broadcast, the cross-rank shape check),
`_optimizer` (DistributedOptimizer, DistributedGradientTape), `callbacks`, `_launch`
(`run`), `_missing` (Horovod names with no equivalent: a one-line error).
"""

from tfscale.horovod import callbacks
from tfscale.horovod._basics import (
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)
from tfscale.horovod._collective import (
    Average,
    Compression,
    Sum,
    allgather,
    allreduce,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
)
from tfscale.horovod._errors import HorovodError
from tfscale.horovod._launch import run
from tfscale.horovod._missing import missing_attribute as _missing_attribute
from tfscale.horovod._optimizer import DistributedGradientTape, DistributedOptimizer

__all__ = [
    "Average",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodError",
    "Sum",
    "allgather",
    "allreduce",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "local_rank",
    "local_size",
    "nccl_built",
    "rank",
    "run",
    "shutdown",
    "size",
]


def nccl_built():
    """False: tfscale.horovod runs on TensorFlow's collectives (NCCL through them on GPUs)."""
    return False


def __getattr__(name):
    return _missing_attribute(__name__, name)
