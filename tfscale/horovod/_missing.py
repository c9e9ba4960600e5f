"""Horovod names tfscale does not provide: a one-line `HorovodError` naming what to use instead.

Looked up by the `__getattr__` of `tfscale.horovod` and `tfscale.horovod.callbacks`, so
`hvd.Adasum` fails with a sentence, not an `AttributeError`; any other unknown name is
still an `AttributeError` (Python's own lookups, `hasattr`, pickling rely on it).
"""

from tfscale.horovod._errors import HorovodError

__all__ = ["MISSING", "missing_attribute"]

_NO_SETS = "no equivalent: every collective spans all ranks"
_ELASTIC = "`tfscale-launch --num_workers MIN:MAX` with tfscale.callbacks.BackupAndRestore"
_PROFILER = "tfscale.callbacks.CommunicationProfiler"
MISSING = {
    "tfscale.horovod": {
        "Adasum": "hvd.Average or hvd.Sum",
        "Min": "no equivalent (hvd.Average or hvd.Sum)",
        "Max": "no equivalent (hvd.Average or hvd.Sum)",
        "Product": "no equivalent (hvd.Average or hvd.Sum)",
        "ProcessSet": _NO_SETS,
        "global_process_set": _NO_SETS,
        "add_process_set": _NO_SETS,
        "remove_process_set": _NO_SETS,
        "elastic": _ELASTIC,
        "join": "no equivalent: give every rank the same number of batches",
        "alltoall": "no equivalent (allgather, then slice)",
        "reducescatter": "no equivalent (allreduce, then slice)",
        "grouped_allgather": "allgather per tensor",
        "grouped_reducescatter": "no equivalent",
        "allgather_object": "broadcast_object per rank",
        "start_timeline": _PROFILER,
        "stop_timeline": _PROFILER,
        "SyncBatchNormalization": "keras.layers.BatchNormalization under "
        'tfscale.strategies.get("multi_worker"), which normalises by the global batch',
        "PartialDistributedGradientTape": (
            "DistributedGradientTape with the local variables left out of `sources`"
        ),
        "PartialDistributedOptimizer": "DistributedOptimizer",
        "broadcast_global_variables": "callbacks.BroadcastGlobalVariablesCallback, or "
        "hvd.broadcast_variables(model.variables + optimizer.variables, root_rank)",
        "load_model": "keras.models.load_model(...), then hvd.DistributedOptimizer on its optimizer",
        "mpi_ops": "the functions of tfscale.horovod",
        "mpi_threads_supported": "no equivalent: tfscale does not use MPI",
        "mpi_enabled": "no equivalent: tfscale does not use MPI",
        "gloo_enabled": "no equivalent: tfscale uses TensorFlow's collectives",
    },
    "tfscale.horovod.callbacks": {
        "BestModelCheckpoint": "keras.callbacks.ModelCheckpoint(save_best_only=True) on rank 0",
        "CommitStateCallback": _ELASTIC,
        "UpdateBatchStateCallback": _ELASTIC,
        "UpdateEpochStateCallback": _ELASTIC,
    },
}


def missing_attribute(module, name):
    """Raises `HorovodError` for a Horovod name tfscale lacks, else `AttributeError`."""
    equivalent = MISSING.get(module, {}).get(name)
    if equivalent is None:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    short = module.replace("tfscale.horovod", "hvd")
    raise HorovodError(f"`{short}.{name}` is not provided by tfscale.horovod. Use {equivalent}.")
