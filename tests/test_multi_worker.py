"""Keras 3 fit/evaluate/predict on real multi-worker clusters (processes on loopback).

Every run is compared with the same model trained in this process on one device with
the same global batch: weights, per-epoch losses, evaluate and predict must agree.
"""

import _foundation_workers as workers
import numpy as np
import pytest

import tfscale.strategies
from tfscale.launch import run_local_cluster

pytestmark = pytest.mark.slow

ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
RTOL, ATOL = 1e-5, 1e-6  # float32 round-off of differently ordered all-reduces


@pytest.fixture(scope="module")
def reference():
    return workers.train_and_report(tfscale.strategies.get("one_device", device="/cpu:0"))


def assert_matches_reference(value, reference):
    for got, want in zip(value["weights"], reference["weights"]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    for key, want in reference["history"].items():
        np.testing.assert_allclose(value["history"][key], want, rtol=RTOL, atol=ATOL)
    for key, want in reference["evaluate"].items():
        np.testing.assert_allclose(value["evaluate"][key], want, rtol=RTOL, atol=ATOL)
    # Every example predicted once, in input order (60 rows, a partial last batch).
    assert value["predict"].shape == reference["predict"].shape
    np.testing.assert_allclose(value["predict"], reference["predict"], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize(
    ("name", "options", "replicas"),
    [("auto", {}, 2), ("multi_worker", {"cpu_replicas": 2}, 4)],
    ids=["auto-2x1", "multi_worker-2x2"],
)
def test_two_worker_fit_matches_single_device(reference, name, options, replicas):
    results = run_local_cluster(
        workers.tfscale_strategy, 2, args=(name,), kwargs=options, timeout=240, env=ENV
    )
    for result in results:
        assert result.value["multi_worker"]
        assert result.value["replicas"] == replicas
        assert_matches_reference(result.value, reference)
    first, second = (r.value for r in results)
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(a, b)  # workers hold identical weights, bit for bit
    assert first["evaluate"] == second["evaluate"]


def test_stock_keras_crashes_without_the_fix_and_trains_with_it(reference):
    crashed = run_local_cluster(
        workers.stock_multi_worker, 2, args=(False,), timeout=240, env=ENV, check=False
    )
    assert all(r.returncode != 0 for r in crashed)
    assert any("Attempt to convert a value (PerReplica" in r.log for r in crashed), crashed[0].log[-2000:]

    fixed = run_local_cluster(workers.stock_multi_worker, 2, args=(True,), timeout=240, env=ENV)
    for result in fixed:
        assert_matches_reference(result.value, reference)
