"""tfscale.strategies: `get(name, **options)` for tf.distribute strategies and tfscale's own.

Layout: `_builtin` (the `get` registry of tf.distribute strategies), `pipeline/` and
`model_split/` (tfscale's two model-parallel strategies), and the layer both stand on:
`_devices` (naming, discovery, resolving a device list), `_remote` (devices
on other tasks of a cluster: `connect_cluster`), `_placement` (copying a chain of
layers onto devices, gradients and optimizer slots beside their variables), `_partition`
(cutting a chain into balanced parts), `_parts` (report and merge of a cut model).
"""

from tfscale.strategies._builtin import NAMES, get
from tfscale.strategies._communication import Communication
from tfscale.strategies._communication import configure as configure_communication
from tfscale.strategies._devices import split_cpu
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._memory import memory_report
from tfscale.strategies._partition import BalanceError
from tfscale.strategies._peers import DEFAULT_CLUSTER_TIMEOUT, ClusterTimeoutError
from tfscale.strategies._remote import connect_cluster
from tfscale.strategies.model_split import (
    ColumnParallelDense,
    HeadParallelMultiHeadAttention,
    ModelSplitError,
    ModelSplitStrategy,
    RowParallelDense,
    VocabParallelEmbedding,
)
from tfscale.strategies.pipeline import PipelineStrategy

__all__ = [
    "DEFAULT_CLUSTER_TIMEOUT",
    "NAMES",
    "BalanceError",
    "ClusterTimeoutError",
    "ColumnParallelDense",
    "Communication",
    "HeadParallelMultiHeadAttention",
    "ModelSplitError",
    "ModelSplitStrategy",
    "PipelineStrategy",
    "RowParallelDense",
    "StrategyError",
    "VocabParallelEmbedding",
    "configure_communication",
    "connect_cluster",
    "get",
    "memory_report",
    "split_cpu",
]
