"""The error type of tfscale.strategies."""

from tfscale.errors import Error

__all__ = ["StrategyError"]


class StrategyError(Error):
    """A strategy name or option that tfscale cannot honour (names the value and the choices)."""
