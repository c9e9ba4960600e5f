"""The version gate of a compat module, checked alike for each: `needed(version)` under `_FIXED_IN`.

Every gated module in `tfscale.compat` applies its fix from Keras 3 up to the release that
fixes upstream (`_FIXED_IN`, None while it is open), never to Keras 2.
"""

from unittest import mock

import pytest

__all__ = ["GATE_CASES", "version_gate_test"]

# (Keras version, the module's `_FIXED_IN`, whether the fix is needed)
GATE_CASES = [
    ("3.15.1", None, True),
    ("3.0.0", None, True),
    ("2.15.0", None, False),
    ("3.15.1", "3.16.0", True),
    ("3.16.0", "3.16.0", False),
    ("3.17.0rc1", "3.16.0", False),
]


def version_gate_test(module):
    """A test of `module.needed` over `GATE_CASES`; bind it as `test_fix_is_version_gated`."""

    @pytest.mark.parametrize(("version", "fixed_in", "needed"), GATE_CASES)
    def test_fix_is_version_gated(version, fixed_in, needed):
        with mock.patch.object(module, "_FIXED_IN", fixed_in):
            assert module.needed(version) is needed

    return test_fix_is_version_gated
