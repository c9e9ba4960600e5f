"""tfscale.datasets: the bundled TFDS builder, load() batching/shuffling/sharding, synthetic input, errors."""

import os

import _train_workers
import numpy as np
import pytest
import tensorflow as tf

import tfscale.datasets
import tfscale.strategies
from tfscale.datasets import DatasetError, digits, synthetic
from tfscale.launch import run_local_cluster

TRAIN, TEST = digits.TRAIN_EXAMPLES, 1797 - digits.TRAIN_EXAMPLES


def _ids(ds):
    return [np.asarray(batch["id"]) for batch in ds]


def test_bundled_builder_holds_every_row_of_the_csv(data_dir):
    pixels, labels = digits.read_csv()
    seen = {}
    for split, n in (("train", TRAIN), ("test", TEST)):
        ds = tfscale.datasets.load("digits", split, 64, data_dir=data_dir, as_supervised=False, shuffle=False)
        batches = list(ds.as_numpy_iterator())
        assert sum(len(b["id"]) for b in batches) == n
        for b in batches:
            for i, row in enumerate(b["id"]):
                seen[int(row)] = split
                # load() gives float32 in [0, 1]: the stored uint8 pixel / 255.
                np.testing.assert_allclose(b["image"][i], pixels[row] / 255.0, rtol=1e-6)
                assert b["label"][i] == labels[row]
    assert sorted(seen) == list(range(1797))
    assert {r for r, s in seen.items() if s == "test"} == set(range(TRAIN, 1797))


def test_builder_is_a_real_tfds_dataset_readable_by_name(data_dir):
    via_tfds = tfscale.datasets.load(
        "tfds:tfscale_digits:1.0.0", "test", 32, data_dir=data_dir, as_supervised=False, shuffle=False
    )
    via_name = tfscale.datasets.load(
        "digits", "test", 32, data_dir=data_dir, as_supervised=False, shuffle=False
    )
    np.testing.assert_array_equal(np.concatenate(_ids(via_tfds)), np.concatenate(_ids(via_name)))
    assert len(os.listdir(os.path.join(data_dir, "tfscale_digits", "1.0.0"))) >= 2 * digits.NUM_FILE_SHARDS


def test_shuffle_is_seeded_reshuffles_each_epoch_and_covers_every_example(data_dir):
    def epochs(seed):
        ds = tfscale.datasets.load("digits", "train", 64, data_dir=data_dir, as_supervised=False, seed=seed)
        return [np.concatenate(_ids(ds)) for _ in range(2)]

    first, again, other = epochs(0), epochs(0), epochs(1)
    for order in first + other:
        assert sorted(order) == list(range(TRAIN))
    np.testing.assert_array_equal(first[0], again[0])
    np.testing.assert_array_equal(first[1], again[1])
    assert (first[0] != first[1]).any() and (first[0] != other[0]).any()


def test_supervised_batches_have_the_global_batch_and_drop_the_remainder(data_dir):
    ds, info = tfscale.datasets.load("digits", "train", 100, data_dir=data_dir, with_info=True)
    shapes = [x.shape for x, _ in ds]
    assert shapes == [(100, 8, 8, 1)] * (TRAIN // 100) and info.steps_per_epoch == TRAIN // 100
    evaluation = tfscale.datasets.load("digits", "test", 100, data_dir=data_dir)
    assert sum(int(y.shape[0]) for _, y in evaluation) == TEST  # the partial batch is kept
    assert info.num_classes == 10 and info.cached and info.sharding == "none"


def test_mirrored_replicas_get_consecutive_slices_of_each_global_batch(data_dir):
    strategy = tfscale.strategies.get("mirrored", cpu_replicas=4)
    kwargs = dict(data_dir=data_dir, as_supervised=False, seed=3)
    reference = _ids(tfscale.datasets.load("digits", "train", 64, **kwargs))
    ds, info = tfscale.datasets.load("digits", "train", 64, strategy, with_info=True, **kwargs)
    assert info.per_replica_batch_size == 16
    for want, batch in zip(reference, strategy.experimental_distribute_dataset(ds)):
        parts = [np.asarray(v) for v in strategy.experimental_local_results(batch["id"])]
        assert [len(p) for p in parts] == [16] * 4
        np.testing.assert_array_equal(np.concatenate(parts), want)


@pytest.mark.slow
def test_two_workers_read_disjoint_parts_that_cover_every_example_once_per_epoch(data_dir):
    results = run_local_cluster(
        _train_workers.shard_ids, 2, args=(data_dir, 64, 2), env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=240
    )
    w0, w1 = (r.value for r in results)
    for policy in ("data", "files"):
        assert (w0[policy]["sharding"], w1[policy]["sharding"]) == (policy, policy)
        for e in range(2):
            a, b = np.concatenate(w0[policy]["epochs"][e]), np.concatenate(w1[policy]["epochs"][e])
            assert len(a) == len(b) == TRAIN // 2
            assert not set(a) & set(b)
            assert sorted(np.concatenate([a, b])) == list(range(TRAIN))
    # "data": the two workers' pieces of step s are exactly one device's global batch s.
    tf.random.set_seed(0)  # as in the workers: the shuffle order depends on the global seed too
    reference = tfscale.datasets.load("digits", "train", 64, data_dir=data_dir, as_supervised=False)
    for e in range(2):
        for s, want in enumerate(_ids(reference)):
            got = np.concatenate([w0["data"]["epochs"][e][s], w1["data"]["epochs"][e][s]])
            np.testing.assert_array_equal(got, want)
    # "files": each worker reads its own file shards, so its ids form whole shards.
    assert set(np.concatenate(w0["files"]["epochs"][0])) == set(np.concatenate(w0["files"]["epochs"][1]))


@pytest.mark.parametrize(
    ("name", "spec"),
    [
        ("synthetic:images/32x32x3/10", synthetic.SyntheticSpec("images", (32, 32, 3), 10, 1024)),
        ("synthetic:images/4x4x1/3/40", synthetic.SyntheticSpec("images", (4, 4, 1), 3, 40)),
        ("synthetic:tokens/16/100/2", synthetic.SyntheticSpec("tokens", (16,), 2, 1024, 100)),
    ],
)
def test_synthetic_grammar(name, spec):
    assert synthetic.parse(name) == spec
    ds, info = tfscale.datasets.load(name, "train", 8, with_info=True)
    x, y = next(iter(ds))
    assert x.shape == (8, *spec.shape) and int(tf.reduce_max(y)) < spec.num_classes
    assert info.num_examples == spec.num_examples and info.num_classes == spec.num_classes


@pytest.mark.parametrize(
    "name",
    [
        "synthetic:images/32x32/10",
        "synthetic:images/0x4x4/2",
        "synthetic:video/1/2",
        "synthetic:tokens/a/2/2",
    ],
)
def test_bad_synthetic_names(name):
    with pytest.raises(DatasetError, match=r"Received: name='synthetic:.*Expected 'synthetic:images/HxWxC"):
        tfscale.datasets.load(name, "train", 8)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(name="nosuch"), r"Unknown dataset\. Received: name='nosuch'\. Expected 'digits'"),
        (dict(split="validation"), r"split='validation'\. Expected one of \['test', 'train'\]"),
        (dict(global_batch_size=0), r"`global_batch_size`\. Received: global_batch_size=0"),
        (dict(global_batch_size=TRAIN + 1), r"larger than the 1536 examples"),
        (dict(data_dir="/nonexistent/tfds"), r"`data_dir='/nonexistent/tfds'` does not exist"),
        (dict(sharding="rows"), r"sharding='rows'\. Expected one of \['auto', 'data', 'files'\]"),
    ],
)
def test_errors_name_the_value_and_the_fix(data_dir, overrides, match):
    kwargs = {"name": "digits", "split": "train", "global_batch_size": 64, "data_dir": data_dir, **overrides}
    with pytest.raises(DatasetError, match=match):
        tfscale.datasets.load(**kwargs)


def test_unprepared_tfds_dataset_is_an_error_that_says_how_to_prepare_it(tmp_path):
    with pytest.raises(
        DatasetError, match=r"`tfds:mnist` is not prepared .* \(`tfds build mnist --data_dir="
    ):
        tfscale.datasets.load("tfds:mnist", "train", 64, data_dir=str(tmp_path))
    with pytest.raises(DatasetError, match=r"`tfds:no_such_dataset_xyz` not found"):
        tfscale.datasets.load("tfds:no_such_dataset_xyz", "train", 64, data_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []  # nothing downloaded, nothing half-written


def test_batch_must_split_evenly_over_replicas(data_dir):
    strategy = tfscale.strategies.get("mirrored", cpu_replicas=4)
    with pytest.raises(DatasetError, match=r"`global_batch_size=66` is not divisible by the 4 replicas"):
        tfscale.datasets.load("digits", "train", 66, strategy, data_dir=data_dir)
