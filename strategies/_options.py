"""Checking a strategy's options: one wording for every strategy's bad input."""

from tfscale.strategies._errors import StrategyError

__all__ = ["positive_int", "reject_unknown"]


def positive_int(name, value):
    """`value` if it is a positive int, else `StrategyError` naming argument `name`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(
            f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected a positive integer."
        )
    return value


def reject_unknown(strategy, unknown, accepted):
    """Raises `StrategyError` naming the unknown options of `strategy` and the accepted ones."""
    if unknown:
        raise StrategyError(
            f"Unknown option(s) {sorted(unknown)} for strategy {strategy!r}. Expected options: "
            f"{list(accepted) or 'none'}."
        )
