"""Checking a strategy's options: one wording for every strategy's bad input."""

from tfscale import _strategy_spec as _spec
from tfscale.strategies._errors import StrategyError

__all__ = ["check", "reject_unknown"]


def check(option, value, argument=None):
    """`value` if it keeps the spec's rule for `option` (`_spec.RULES`), else `StrategyError`.

    Args:
        option: a key of `tfscale._strategy_spec.RULES`.
        value: the value given.
        argument: the name the error shows, where the caller's differs from `option`.
    """
    problem = _spec.option_problem(option, value, argument)
    if problem:
        raise StrategyError(problem)
    return value


def reject_unknown(strategy, unknown, accepted):
    """Raises `StrategyError` naming the unknown options of `strategy` and the accepted ones."""
    if unknown:
        raise StrategyError(
            f"Unknown option(s) {sorted(unknown)} for strategy {strategy!r}. Expected options: "
            f"{list(accepted) or 'none'}."
        )
