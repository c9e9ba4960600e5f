"""bench/_paired.py: the paired-rounds method's order and arithmetic (no TensorFlow)."""

import collections
import importlib.util
import os
import subprocess
import sys

import pytest

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench")


def _load(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(BENCH, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


paired = _load("_paired")


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_each_variant_sits_in_each_position_twice_over_2n_rounds(n):
    labels = [f"v{i}" for i in range(n)]
    positions = collections.Counter()
    for r in range(2 * n):
        round_order = paired.order(labels, r)
        assert sorted(round_order) == labels  # every variant once a round
        positions.update((label, i) for i, label in enumerate(round_order))
    assert set(positions.values()) == {2}
    assert len(positions) == n * n


def test_order_alternates_direction():
    assert paired.order("abc", 0) == ["a", "b", "c"]
    assert paired.order("abc", 1) == ["c", "b", "a"]
    assert paired.order("abc", 2) == ["b", "c", "a"]


def test_ratios_are_to_the_same_rounds_baseline_with_median_and_spread():
    # A drifting machine: the baseline doubles from round to round, the variant stays 10% slower.
    rounds = [
        {"base": {"value": 1.0}, "slow": {"value": 1.1, "ms": 3}},
        {"base": {"value": 2.0}, "slow": {"value": 2.2, "ms": 5}},
        {"base": {"value": 4.0}, "slow": {"value": 4.0, "ms": 4}},
    ]
    summary = paired.summarize(rounds, baseline="base")
    slow = summary["variants"]["slow"]
    assert slow["ratios"] == pytest.approx([1.1, 1.1, 1.0])
    assert slow["ratio"] == pytest.approx({"median": 1.1, "min": 1.0, "max": 1.1})
    assert slow["value"] == pytest.approx({"median": 2.2, "min": 1.1, "max": 4.0})
    assert slow["extras"] == {"ms": 4}
    assert summary["variants"]["base"]["ratio"] == {"median": 1.0, "min": 1.0, "max": 1.0}


def test_run_adds_the_control_runs_every_variant_each_round_and_skips_warmup():
    calls = []
    clock = iter(range(1, 1000))

    def variant(label, scale):
        def measure():
            calls.append(label)
            return {"value": scale * next(clock), "label_len": len(label)}

        return measure

    summary = paired.run(
        {"base": variant("base", 1.0), "x": variant("x", 2.0)}, baseline="base", rounds=4, warmup=1
    )
    # Control runs the baseline's callable: 3 variants x 5 rounds.
    assert collections.Counter(calls) == {"base": 10, "x": 5}
    assert set(summary["variants"]) == {"base", "x", paired.CONTROL}
    assert summary["rounds"] == 4 and summary["warmup"] == 1
    assert len(summary["variants"]["x"]["ratios"]) == 4
    assert summary["load_start"] is None or len(summary["load_start"]) == 3
    # In round index 1 (warm-up is index 0) the order is reversed: control, x, base.
    assert calls[3:6] == ["base", "x", "base"]


def test_beyond_control_is_the_median_above_the_controls_widest_ratio():
    rounds = [
        {"b": {"value": 1.0}, paired.CONTROL: {"value": 1.02}, "v": {"value": 1.05}},
        {"b": {"value": 1.0}, paired.CONTROL: {"value": 0.99}, "v": {"value": 1.01}},
        {"b": {"value": 1.0}, paired.CONTROL: {"value": 1.00}, "v": {"value": 1.04}},
    ]
    summary = paired.summarize(rounds, baseline="b")
    assert paired.beyond_control(summary, "v") == pytest.approx(0.04 - 0.02)
    table = paired.format_table({**summary, "load_start": [8.0, 7.5, 7.0], "load_end": [9.0, 8.0, 7.0]})
    assert "+4.0%" in table and "8.00/7.50/7.00" in table and paired.CONTROL in table


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="baseline='nope'"):
        paired.run({"a": lambda: 1.0}, baseline="nope", rounds=1)
    with pytest.raises(ValueError, match="rounds=0"):
        paired.run({"a": lambda: 1.0}, baseline="a", rounds=0)


def test_device_proof_without_a_gpu_says_so_in_one_line_and_exits_0():
    proof = os.path.join(BENCH, "device_proof.py")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="3")
    proc = subprocess.run(
        [sys.executable, proof], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no GPU" in lines[0], proc.stdout
