"""`tfds:NAME` on a real TFDS dataset prepared offline here, and the larger-than-memory path.

The dataset is `_tiny_tfds.TfscaleTiny`, built into a temporary `data_dir` as TFRecord
files. What `load` returns is checked against the builder's generator and against the
TFRecord files read directly, without TFDS's reader.
"""

import glob
import os

import _tiny_tfds as tiny
import numpy as np
import pytest
import tensorflow as tf

import tfscale.datasets
from tfscale.launch import run_local_cluster

TRAIN = list(tiny.SPLITS["train"])


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tfds"))
    tiny.prepare(path)
    return path


def _file_ids(data_dir, split="train"):
    """{TFRecord file: the set of example ids in it}, read from the files themselves."""
    builder = tiny.TfscaleTiny(data_dir=data_dir)
    pattern = os.path.join(builder.data_dir, f"{tiny.NAME}-{split}.tfrecord-*")
    features = builder.info.features
    return {
        os.path.basename(path): {
            int(features.deserialize_example(r)["id"]) for r in tf.data.TFRecordDataset(path)
        }
        for path in sorted(glob.glob(pattern))
    }


def test_tfds_name_reads_every_example_of_the_prepared_split(data_dir):
    ds, info = tfscale.datasets.load(
        f"tfds:{tiny.NAME}", "test", 8, data_dir=data_dir, as_supervised=False, with_info=True
    )
    assert (info.num_examples, info.num_classes, info.cached, info.sharding) == (24, 3, True, "none")
    seen = []
    for batch in ds.as_numpy_iterator():
        for i, x, label in zip(batch["id"], batch["x"], batch["label"]):
            want = tiny.example(int(i))
            np.testing.assert_array_equal(x, want["x"])  # float32 features pass through unscaled
            assert label == want["label"]
            seen.append(int(i))
    assert sorted(seen) == list(tiny.SPLITS["test"])


def test_tfds_name_with_version_gives_supervised_shuffled_batches(data_dir):
    ds = tfscale.datasets.load(f"tfds:{tiny.NAME}:1.0.0", "train", 16, data_dir=data_dir, seed=1)
    batches = list(ds.as_numpy_iterator())
    assert [x.shape for x, _ in batches] == [(16, 6)] * (len(TRAIN) // 16)
    xs, ys = np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])
    ids = xs[:, 0].astype(int)  # example(i)["x"][0] == i
    assert sorted(ids) == TRAIN and list(ids) != TRAIN  # every example, shuffled
    np.testing.assert_array_equal(ys, ids % tiny.NUM_CLASSES)


def test_prepared_split_has_one_file_per_shard(data_dir):
    files = _file_ids(data_dir)
    assert len(files) == tiny.NUM_SHARDS
    assert sorted(i for ids in files.values() for i in ids) == TRAIN


@pytest.mark.slow
def test_larger_than_memory_split_gives_each_worker_its_own_whole_files(data_dir):
    results = run_local_cluster(
        tiny.worker_ids, 2, args=(data_dir, 8, 2), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=240
    )
    workers = sorted((r.value for r in results), key=lambda w: w["worker_index"])
    assert [(w["sharding"], w["cached"]) for w in workers] == [("files", False)] * 2
    files = _file_ids(data_dir)
    owned = []
    for w in workers:
        first, second = (set(map(int, e)) for e in w["epochs"])
        assert first == second  # the same files every epoch ...
        assert list(w["epochs"][0]) != list(w["epochs"][1])  # ... read in a new order
        # ... and only whole files: no worker reads part of another's.
        mine = [name for name, ids in files.items() if ids <= first]
        assert set().union(*(files[name] for name in mine)) == first
        owned.append(set(mine))
    assert not owned[0] & owned[1] and len(owned[0]) == len(owned[1]) == tiny.NUM_SHARDS // 2
    assert sorted(np.concatenate([w["epochs"][0] for w in workers])) == TRAIN
