"""Every model-parallel mode gives plain Keras's result, or refuses in one line: generated cases.

The cases, the comparison and the tiers are in tests/_equivalence.py (read its docstring):
    fast  pytest tests/test_equivalence.py -m "not slow"       (pairwise cover)
    ci    pytest tests/test_equivalence.py -m slow             (a seeded wider sample)
    full  TFSCALE_EQUIVALENCE=full pytest tests/test_equivalence.py -m slow   (the whole cross)
Each case passes when EQUAL, REFUSED (one line, before any step, nothing changed) or N/A
(plain Keras itself rejects the combination). The per-mode table:
`python tests/_equivalence.py fast --markdown table.md`.
"""

import os

import _equivalence as eq
import numpy as np
import pytest

from tfscale import errors

PASS = ("EQUAL", "REFUSED", "N/A")
FAST = eq.tier_cases("fast")
WIDE = eq.tier_cases("full" if os.environ.get("TFSCALE_EQUIVALENCE") == "full" else "ci")


def _check(case):
    outcome = eq.run_case(case)
    assert outcome.outcome in PASS, f"{outcome.outcome}: {case.id}: {outcome.detail}"


@pytest.mark.parametrize("case", FAST, ids=lambda c: c.id)
def test_mode_equals_plain_keras(case):
    _check(case)


@pytest.mark.slow
@pytest.mark.parametrize("case", WIDE, ids=lambda c: c.id)
def test_mode_equals_plain_keras_wide(case):
    _check(case)


def test_pairwise_covers_every_pair():
    names = list(eq.DIMENSIONS)
    seen = {
        ((a, getattr(c, a)), (b, getattr(c, b)))
        for c in FAST
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            for va in eq.DIMENSIONS[a]:
                for vb in eq.DIMENSIONS[b]:
                    if eq.valid({a: va, b: vb}):
                        assert ((a, va), (b, vb)) in seen, (a, va, b, vb)
    assert all(eq.valid(vars(c)) for c in FAST)
    assert eq.pairwise() == FAST  # deterministic: a failure reproduces by its id


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


def test_a_refusal_on_several_lines_is_a_crash():
    def refuse(stage, model):
        if stage == "split":
            raise errors.Error("Invalid value for argument `x`.\nExpected one line.")

    outcome = eq.run_case(_PLAIN, tamper=refuse)
    assert outcome.outcome == "CRASH" and "not one line" in outcome.detail, outcome


def test_a_refusal_after_a_step_is_a_crash():
    def refuse_late(stage, model):
        if stage == "fit":
            raise errors.Error("Invalid value for argument `x`. Expected one line.")

    outcome = eq.run_case(_PLAIN, tamper=refuse_late)
    assert outcome.outcome == "CRASH" and "after weights changed" in outcome.detail, outcome


def test_a_one_line_refusal_before_any_step_passes():
    def refuse(stage, model):
        if stage == "split":
            raise errors.Error("Invalid value for argument `x`. Expected one line.")

    assert eq.run_case(_PLAIN, tamper=refuse).outcome == "REFUSED"
