"""Narrow, version-gated fixes for Keras 3 under tf.distribute (see each module)."""

from tfscale.compat.keras_loss_denominator import apply as apply_loss_fixes
from tfscale.compat.keras_multi_worker import apply as apply_multi_worker_fixes
from tfscale.compat.keras_optimizer import apply as apply_optimizer_fixes

__all__ = ["apply_loss_fixes", "apply_multi_worker_fixes", "apply_optimizer_fixes"]
