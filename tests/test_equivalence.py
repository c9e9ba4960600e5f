"""Every model-parallel mode gives plain Keras's result, or refuses in one line: generated cases.

The cases, the comparison and the tiers are in tests/_equivalence.py (read its docstring):
    smoke     pytest tests/test_equivalence.py -m "not slow"   (one case per mode, M and D,
              one per value added later (eq.ADDED), and the REGRESSIONS; the pairwise ones
              are those same pairwise cases, run once)
    pairwise  pytest tests/test_equivalence.py -m slow         (the pairwise cover: the CI gate)
    ci/full   TFSCALE_EQUIVALENCE=ci|full pytest tests/test_equivalence.py -m slow
Each case passes when EQUAL, REFUSED (one line, before any step, nothing changed) or N/A
(plain Keras itself rejects the combination). The per-mode table:
`python tests/_equivalence.py fast --markdown table.md`.
"""

import os
import time

import _equivalence as eq
import numpy as np
import pytest

from tfscale import errors

# The cases share nothing but a cache of reference runs: xdist deals them out one by one.
SPREAD_OVER_WORKERS = True
PASS = ("EQUAL", "REFUSED", "N/A")
SMOKE = eq.tier_cases("smoke")
PAIRWISE = eq.tier_cases("fast")
WIDE_TIER = os.environ.get("TFSCALE_EQUIVALENCE")  # "ci" or "full": on demand

# Open differences, each a strict xfail with its reason: listed, never hidden, and a case
# that starts to pass fails the run until it is taken off this list.
KNOWN = {}  # none open (the last: mirrored's Dropout masks, tfscale/compat/keras_random_layers.py)


def _param(case):
    reason = KNOWN.get(case.id)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    # Each case runs once per run: the smoke cases and the pairwise cases the harness found
    # (REGRESSIONS, below) are the fast tier's part of the cover; the rest is slow.
    if case not in _FAST:
        marks.append(pytest.mark.slow)
    return pytest.param(case, id=case.id, marks=marks)


def _check(case):
    start = time.monotonic()
    outcome = eq.run_case(case)
    _log(outcome, time.monotonic() - start)
    assert outcome.outcome in PASS, f"{outcome.outcome}: {case.id}: {outcome.detail}"


def _log(outcome, seconds):
    """With TFSCALE_EQUIVALENCE_LOG=FILE, each case's line as `_equivalence.py` prints it, so
    that a pytest run (both workers append) gives the per-mode table: `python
    tests/_equivalence.py --from-log FILE --markdown table.md`."""
    path = os.environ.get("TFSCALE_EQUIVALENCE_LOG")
    if path:
        detail = " ".join(outcome.detail.split())
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"[1/1 {seconds:.0f}s] {outcome.outcome:7} {outcome.case.id} {detail}\n")


# Cases the harness found differing or crashing, fixed at their cause: kept in the fast tier.
REGRESSIONS = [
    eq.Case("tensor", 1, 1, "adam", "none", "lstm_masked", "fit"),  # split Dense dropped the mask
    eq.Case("tensor", 1, 1, "adadelta", "weight_decay", "conv", "save_load_weights"),  # shard file
    eq.Case("tensor", 1, 2, "rmsprop", "lr_schedule", "add_loss", "uneven_tf_data"),  # penalty share
    eq.Case("layer", 1, 2, "ftrl", "global_clipnorm", "gru_timestep_masked", "uneven_numpy"),  # tf.split
    eq.Case("tensor", 1, 2, "adagrad", "clipvalue", "bidirectional_masked", "uneven_tf_data"),
    eq.Case("1f1b", 2, 1, "adam", "none", "batchnorm", "evaluate"),  # per-micro-batch statistics: refused
    eq.Case("zb-h1", 2, 1, "lion", "global_clipnorm", "dropout", "validation_data"),  # masks: refused
    eq.Case("gpipe", 2, 1, "nadam", "mixed_float16", "embedding_repeated", "save_load_model"),  # u_product
    eq.Case("layer", 1, 2, "ftrl", "exclude_weight_decay", "embedding_repeated", "freeze_unfreeze"),  # D=2
    eq.Case("gpipe", 2, 1, "adafactor", "weight_decay", "regularizers", "save_load_model"),  # slots "kernel"
    # The stage's control edges kept grappler from fusing MatMul+BiasAdd+tanh as in plain Keras:
    # float16 rounds the two differently, and Adam made it 0.03 (found outside the cover).
    eq.Case("gpipe", 1, 1, "adam", "mixed_float16", "dense", "fit"),
    eq.Case("1f1b", 2, 1, "adamw", "mixed_float16", "dense", "fit"),
    # Each replica drew the first rows of one device's Dropout mask (keras_random_layers).
    eq.Case("mirrored", 1, 2, "adamw", "none", "dropout", "backup_resume"),
    eq.Case("zero1", 1, 2, "sgd_nesterov", "accumulation", "dropout", "sample_weight"),
    # An RNN cell draws its dropout masks in inference too (unused): the pipeline's inference
    # micro-batches drew them M times a batch (one device: once), and evaluate, run on copy 0
    # only, moved copy 0's seeds alone, so the next epoch's masks differed (_replicas).
    eq.Case("1f1b", 2, 1, "sgd", "none", "rnn_dropout", "validation_data"),
    eq.Case("gpipe", 1, 2, "sgd", "none", "rnn_dropout", "validation_data"),
    # Augmentation layers and a user's keras.random layer drew for each replica's, copy's or
    # micro-batch's rows alone (loss 3-18% off; keras_random_layers, _replicas).
    eq.Case("mirrored", 1, 2, "sgd", "none", "augment", "fit"),
    eq.Case("tensor", 1, 2, "sgd", "none", "augment", "fit"),
    # `merge` handed Keras the user's functional config, which `functional_from_config` empties:
    # a second merge (save after a merge) crashed (_parts.merge).
    eq.Case("layer", 1, 2, "sgd", "none", "graph", "save_load_model"),
]
_FAST = set(SMOKE) | set(REGRESSIONS)
# The fast cases with a value added later (eq.ADDED): first in the parametrization, so that
# the fast tier keeps them beside the first 12 of the others.
_ADDED_FAST = [c for c in PAIRWISE if c in _FAST and any(getattr(c, n) in v for n, v in eq.ADDED.items())]

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_mode_equals_plain_keras_pairwise": 12 + len(_ADDED_FAST),
}


@pytest.mark.parametrize(
    "case", [_param(c) for c in _ADDED_FAST + [c for c in PAIRWISE if c not in _ADDED_FAST]]
)
def test_mode_equals_plain_keras_pairwise(case):
    _check(case)


if WIDE_TIER:

    @pytest.mark.slow
    @pytest.mark.parametrize("case", eq.tier_cases(WIDE_TIER), ids=lambda c: c.id)
    def test_mode_equals_plain_keras_wide(case):
        _check(case)


# A regression that is not (or no longer) a pairwise case runs on its own, in the fast tier.
@pytest.mark.parametrize("case", [c for c in REGRESSIONS if c not in set(PAIRWISE)], ids=lambda c: c.id)
def test_cases_found_by_the_harness_stay_fixed(case):
    _check(case)


def test_smoke_cases_are_pairwise_cases_of_every_split_mode():
    assert {(c.mode, c.m, c.dp) for c in SMOKE} == {
        (c.mode, c.m, c.dp) for c in PAIRWISE if c.mode != "mirrored"
    }
    assert set(SMOKE) <= set(PAIRWISE) and set(KNOWN) <= {c.id for c in PAIRWISE}


def test_pairwise_covers_every_pair():
    names = list(eq.DIMENSIONS)
    seen = {
        ((a, getattr(c, a)), (b, getattr(c, b)))
        for c in PAIRWISE
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for va in eq.DIMENSIONS[a]:
                for vb in eq.DIMENSIONS[b]:
                    if eq.valid({a: va, b: vb}):
                        assert ((a, va), (b, vb)) in seen, (a, va, b, vb)
    assert all(eq.valid(vars(c)) for c in PAIRWISE)
    assert eq.pairwise() == PAIRWISE  # deterministic: a failure reproduces by its id


# The harness itself must be able to fail: the same cases, broken on purpose.
_PLAIN = eq.Case("1f1b", 2, 1, "sgd", "none", "dense", "fit")


def test_a_perturbed_weight_in_the_mode_is_a_difference():
    def perturb(stage, model):
        if stage == "fit":
            w = model.get_weights()
            w[0] = w[0] + np.float32(3e-5)
            model.set_weights(w)

    assert eq.run_case(_PLAIN).outcome == "EQUAL"
    broken = eq.run_case(_PLAIN, tamper=perturb)
    assert broken.outcome == "DIFFER" and broken.detail.startswith("weights[0] off by 3e-05"), broken


_ONE_LINE = "Invalid value for argument `x`. Expected one line."


@pytest.mark.parametrize(
    ("at", "message", "outcome", "detail"),
    [
        ("split", _ONE_LINE.replace(" Expected", "\nExpected"), "CRASH", "not one line"),
        ("fit", _ONE_LINE, "CRASH", "after weights changed"),
        ("split", _ONE_LINE, "REFUSED", ""),
    ],
    ids=["several_lines_is_a_crash", "after_a_step_is_a_crash", "one_line_before_any_step_passes"],
)
def test_a_refusal_passes_only_on_one_line_before_any_step(at, message, outcome, detail):
    def refuse(stage, model):
        if stage == at:
            raise errors.Error(message)

    got = eq.run_case(_PLAIN, tamper=refuse)
    assert got.outcome == outcome and detail in got.detail, got


def test_every_mode_builds_its_strategy():
    # A case passes when REFUSED, so a mode whose options the harness gets wrong (zb-v
    # without virtual_stages=2) would pass refused everywhere: each mode must build.
    for case in SMOKE:
        assert eq._strategy(case) is not None, case.id
