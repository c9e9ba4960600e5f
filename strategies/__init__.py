"""tfscale.strategies: `get(name, **options)` for tf.distribute strategies and tfscale's own."""

from tfscale.strategies._builtin import NAMES, get
from tfscale.strategies._communication import Communication
from tfscale.strategies._communication import configure as configure_communication
from tfscale.strategies._devices import split_cpu
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._partition import BalanceError
from tfscale.strategies.layers import (
    ColumnParallelDense,
    HeadParallelMultiHeadAttention,
    ModelSplitError,
    RowParallelDense,
    VocabParallelEmbedding,
)
from tfscale.strategies.model_split import ModelSplitStrategy
from tfscale.strategies.pipeline import PipelineStrategy

__all__ = [
    "NAMES",
    "BalanceError",
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
    "get",
    "split_cpu",
]
