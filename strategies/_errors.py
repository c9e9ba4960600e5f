"""The error type of tfscale.strategies."""

__all__ = ["StrategyError"]


class StrategyError(ValueError):
    """A strategy name or option that tfscale cannot honour (names the value and the choices)."""
