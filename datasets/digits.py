"""The bundled dataset: UCI handwritten digits (8x8, 1797 images) as a real TFDS builder.

The data ships in the repository (`data/digits.csv.gz`, CC BY 4.0, see
`data/LICENSE-digits.txt`), so the default training job needs no network. It goes
through `tfds.core.GeneratorBasedBuilder` like any TFDS dataset: prepared once into
`data_dir` (TFRecord shards + `dataset_info.json`), then read with TFDS's reader,
so per-worker file sharding (`tfds.ReadConfig(input_context=...)`) is exercised.
"""

import contextlib
import fcntl
import gzip
import logging
import os
from typing import ClassVar

import numpy as np
import tensorflow_datasets as tfds
from etils import epath

__all__ = ["NUM_FILE_SHARDS", "TRAIN_EXAMPLES", "TfscaleDigits", "csv_path", "prepare", "read_csv"]

TRAIN_EXAMPLES = 1536  # rows 0..1535; divisible by 2..4 workers x common batch sizes
NUM_FILE_SHARDS = 4  # file shards per split, so file sharding works for up to 4 workers
_log = logging.getLogger("tfscale")


def csv_path():
    """Path of the bundled `digits.csv.gz`."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "digits.csv.gz")


def read_csv(path=None):
    """Returns `(pixels, labels)`: uint8 (1797, 8, 8, 1) images scaled to 0..255, int64 labels."""
    with gzip.open(path or csv_path(), "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.int64)
    # Pixels are counts 0..16; x16 (clipped) makes them an ordinary 8-bit image.
    pixels = np.minimum(rows[:, :64] * 16, 255).astype(np.uint8).reshape(-1, 8, 8, 1)
    return pixels, rows[:, 64]


class TfscaleDigits(tfds.core.GeneratorBasedBuilder):
    """UCI optical handwritten digits (Alpaydin & Kaynak 1998), bundled with tfscale."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES: ClassVar[dict] = {"1.0.0": "UCI optdigits test set, bundled; `id` added."}

    # TFDS derives this from the top-level package (`tfscale/datasets/digits.py`, which does
    # not exist: this folder installs through `package_dir`), and on Python >= 3.9 its
    # fallback touches `importlib_resources`, which TFDS 4.9.x does not install. Say it here.
    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        return epath.Path(os.path.abspath(__file__))

    def _info(self):
        # Built directly: `dataset_info_from_configs` looks for metadata files next to the module.
        return tfds.core.DatasetInfo(
            builder=self,
            description="8x8 handwritten digits, 1797 images, 10 classes (UCI optdigits test set).",
            features=tfds.features.FeaturesDict(
                {
                    "image": tfds.features.Image(shape=(8, 8, 1), dtype=np.uint8),
                    "label": tfds.features.ClassLabel(num_classes=10),
                    "id": np.int64,
                }
            ),
            supervised_keys=("image", "label"),
            homepage="https://archive.ics.uci.edu/dataset/80/optical+recognition+of+handwritten+digits",
            citation="Alpaydin, E. & Kaynak, C. (1998). Optical Recognition of Handwritten Digits. "
            "UCI Machine Learning Repository. https://doi.org/10.24432/C50P49",
            license="CC BY 4.0",
        )

    # TFDS prints "Downloading and preparing dataset Unknown size (download: Unknown size, ...)"
    # and a "prepared" banner to stdout; nothing is downloaded here, so say what happens instead.
    def _log_download_bytes(self):
        _log.info("preparing the bundled digits dataset in %s (once)", self.data_dir)

    def _log_download_done(self):
        pass

    def _split_generators(self, dl_manager):
        del dl_manager  # Bundled data: nothing to download.
        pixels, labels = read_csv()
        rows = np.arange(len(labels))
        return {
            "train": self._generate_examples(pixels, labels, rows[:TRAIN_EXAMPLES]),
            "test": self._generate_examples(pixels, labels, rows[TRAIN_EXAMPLES:]),
        }

    def _generate_examples(self, pixels, labels, rows):
        for row in rows:
            yield int(row), {"image": pixels[row], "label": int(labels[row]), "id": int(row)}


@contextlib.contextmanager
def _lock(data_dir):
    # Every worker of a local cluster may prepare the same data_dir at once.
    with open(os.path.join(data_dir, ".tfscale_digits.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(data_dir):
    """Returns the digits builder for `data_dir`, preparing it there first if needed."""
    os.makedirs(data_dir, exist_ok=True)
    with _lock(data_dir):
        builder = TfscaleDigits(data_dir=data_dir)
        if not builder.is_prepared():
            with _no_progress_bars():
                builder.download_and_prepare(
                    download_config=tfds.download.DownloadConfig(num_shards=NUM_FILE_SHARDS)
                )
    return builder


@contextlib.contextmanager
def _no_progress_bars():
    # TFDS draws tqdm bars (carriage returns, cursor moves) for a second of work on 1797
    # rows; the user's own setting (tfds.display_progress_bar) is put back afterwards.
    from tensorflow_datasets.core.utils import tqdm_utils

    was = getattr(tqdm_utils, "_active", True)
    tfds.display_progress_bar(False)
    try:
        yield
    finally:
        tfds.display_progress_bar(was)
