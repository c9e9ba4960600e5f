"""ZeRO sharding of the training state over data-parallel replicas: the `zero_stage` option.

`tfscale.strategies.get("mirrored", zero_stage=N)` checks the stage here and marks the
strategy; the optimizers built in its scope then keep their slots as 1/N shards
(`tfscale.compat.keras_optimizer_zero` holds the mechanism, which needs Keras internals).
"""

from tfscale.compat import keras_optimizer_zero
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check

__all__ = ["STAGES", "check_stage", "configure"]

STAGES = (0, 1, 2)  # 3 (parameters sharded at rest) is not built yet


def check_stage(stage):
    """`stage` if it is a ZeRO stage this strategy runs, else `StrategyError` naming it."""
    check("zero_stage", stage)
    if stage not in STAGES:
        raise StrategyError(
            f"zero_stage={stage} (parameters sharded at rest) is not available yet. Expected one of "
            f"{list(STAGES)}."
        )
    return stage


def check_strategy(name, stage):
    """`StrategyError` for `zero_stage` given to a strategy whose variables are not mirrored."""
    if name != "mirrored":
        raise StrategyError(
            f"Option `zero_stage={stage!r}` does not apply to strategy {name!r}: ZeRO shards the "
            "state of mirrored replicas. Expected strategy 'mirrored' (multi_worker: not yet)."
        )


def configure(strategy, stage):
    """Marks `strategy` so the optimizers built in its scope shard their state at `stage`."""
    keras_optimizer_zero.set_stage(strategy, stage)
