"""tfscale.strategies: `get(name, **options)` for tf.distribute strategies and tfscale's own."""

from tfscale.strategies._builtin import NAMES, get
from tfscale.strategies._devices import split_cpu
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._partition import BalanceError

__all__ = ["NAMES", "BalanceError", "StrategyError", "get", "split_cpu"]
