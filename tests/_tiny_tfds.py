"""A tiny TFDS dataset built in the tests: a real `GeneratorBasedBuilder`, prepared offline.

Unlike the bundled digits, its feature is a float32 vector (not a uint8 image) and its
examples are a pure function of their `id`, so a test can check every value it reads.
Also run in the tasks of a local cluster (`worker_file_ids`).
"""

import os
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

__all__ = ["NAME", "NUM_CLASSES", "NUM_SHARDS", "SPLITS", "TfscaleTiny", "example", "prepare", "worker_ids"]

NAME = "tfscale_tiny"
NUM_CLASSES = 3
NUM_SHARDS = 4
SPLITS = {"train": range(0, 96), "test": range(96, 120)}


def example(i):
    """Example `i`: features [i, i+0.5, ..., i+2.5], label i mod 3."""
    return {"x": np.arange(6, dtype=np.float32) / 2 + i, "label": i % NUM_CLASSES, "id": i}


class TfscaleTiny(tfds.core.GeneratorBasedBuilder):
    """120 examples of 6 floats, 3 classes."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict] = {"1.0.0": "Test dataset."}

    # As for tfscale's digits builder: TFDS cannot derive this for a module outside a package.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return epath.Path(os.path.abspath(__file__))

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {
                    "x": tfds.features.Tensor(shape=(6,), dtype=np.float32),
                    "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
                    "id": np.int64,
                }
            ),
            supervised_keys=("x", "label"),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # generated: nothing to download
        return {split: self._generate_examples(ids) for split, ids in SPLITS.items()}

    def _generate_examples(self, ids):
        for i in ids:
            yield i, example(i)


def prepare(data_dir):
    """Builds the dataset into `data_dir` as TFRecord files, `NUM_SHARDS` per split."""
    builder = TfscaleTiny(data_dir=data_dir)
    builder.download_and_prepare(download_config=tfds.download.DownloadConfig(num_shards=NUM_SHARDS))
    return builder


def worker_ids(data_dir, global_batch_size, epochs):
    """In a cluster task: what `load` gives this worker for the large-data path, by epoch."""
    import tfscale.datasets
    import tfscale.strategies

    strategy = tfscale.strategies.get("multi_worker")
    # cache=False: the split is treated as larger than memory, so "auto" must pick "files".
    ds, info = tfscale.datasets.load(
        f"tfds:{NAME}", "train", global_batch_size, strategy, data_dir=data_dir, cache=False,
        as_supervised=False, with_info=True,
    )  # fmt: skip
    return {
        "sharding": info.sharding,
        "cached": info.cached,
        "worker_index": info.worker_index,
        "epochs": [np.concatenate([b["id"] for b in ds.as_numpy_iterator()]) for _ in range(epochs)],
    }
