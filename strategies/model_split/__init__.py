"""Model split: `ModelSplitStrategy` places a Keras model's parts, or layer shards, on devices.

Modules, one mechanism each:
- `strategy`: `ModelSplitStrategy` (options, `split` / `merge` / `report`);
- `models`: the Keras model classes a split returns (layers run on their devices);
- `graph`: layer split of any functional graph (`SplitGraph`: parts run as hops, live
  tensors carried across each cut);
- `tensor_split`: rewriting Dense / Embedding / MultiHeadAttention into their split forms;
- `layers`: the tensor-split (Megatron-style) layers themselves.
"""

from tfscale.strategies.model_split.layers import (
    ColumnParallelDense,
    HeadParallelMultiHeadAttention,
    ModelSplitError,
    RowParallelDense,
    VocabParallelEmbedding,
)
from tfscale.strategies.model_split.strategy import ModelSplitStrategy

__all__ = [
    "ColumnParallelDense",
    "HeadParallelMultiHeadAttention",
    "ModelSplitError",
    "ModelSplitStrategy",
    "RowParallelDense",
    "VocabParallelEmbedding",
]
