"""tfscale.datasets: datasets ready for `fit` under any strategy, sharded per worker.

    ds = tfscale.datasets.load("digits", "train", global_batch_size=64, strategy=strategy)
    model.fit(ds, epochs=5)

Names: `"digits"` (bundled UCI handwritten digits, no network), `"tfds:NAME[/CONFIG][:VERSION]"`
(any TFDS dataset already prepared in `data_dir`), `"synthetic:..."` (benchmarks).
"""

from tfscale.datasets._errors import DatasetError, UnknownSplitError
from tfscale.datasets._sources import BUNDLED, default_data_dir
from tfscale.datasets.load import SHARDING_POLICIES, DatasetInfo, load

__all__ = [
    "BUNDLED",
    "SHARDING_POLICIES",
    "DatasetError",
    "DatasetInfo",
    "UnknownSplitError",
    "default_data_dir",
    "load",
]
