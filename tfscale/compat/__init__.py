"""Narrow, version-gated fixes for Keras 3 under tf.distribute (see each module).

The sets of fixes each strategy needs live here, once, so their users cannot drift apart:

- `apply_every_strategy_fixes()`: what `tfscale.strategies.get` applies for every strategy
  it builds (custom-gradient graphs freed, input iterators parked, `steps_per_execution`
  step by step, `keras.ops.add` broadcasting a (batch, 1) term whatever the batch size);
- `apply_strategy_fixes()`: everything a `MirroredStrategy` / `MultiWorkerMirroredStrategy`
  needs for one-device results, the above plus `apply_multi_worker_fixes()` (`fit` works
  under MWMS; uneven per-replica batches), `apply_optimizer_fixes()` (clipping after the
  all-reduce, gradient accumulation, the strategy's options), `apply_loss_fixes()` (mean
  losses over the global batch: uneven last batch, masks, sample weights) and
  `keras_batch_norm.apply()` (a trainable BatchNormalization normalises by the global
  batch's statistics, unless the strategy keeps per-replica ones) and
  `keras_random_layers.apply()` (Dropout and the other random layers draw one device's
  numbers, unless the strategy keeps per-replica draws).
  `get("mirrored" | "multi_worker")` (and `"auto"` when it picks one of them) applies it,
  and so does `tfscale-launch --keras_compat` in programs that build their own strategy;
  call it once yourself for a strategy you build by hand.

Each fix is gated on its own: it does nothing where upstream is fixed or the patched
Keras/TensorFlow internals are gone.
"""

from tfscale.compat import (
    keras_add,
    keras_batch_norm,
    keras_loss_denominator,
    keras_multi_worker,
    keras_optimizer,
    keras_random_layers,
    keras_steps_per_execution,
    keras_symbolic_build,
    tf_custom_gradient,
)
from tfscale.compat.keras_loss_denominator import apply as apply_loss_fixes
from tfscale.compat.keras_multi_worker import apply as apply_multi_worker_fixes
from tfscale.compat.keras_optimizer import apply as apply_optimizer_fixes

__all__ = [
    "apply_every_strategy_fixes",
    "apply_loss_fixes",
    "apply_multi_worker_fixes",
    "apply_optimizer_fixes",
    "apply_strategy_fixes",
]


def apply_every_strategy_fixes():
    """Applies the fixes `tfscale.strategies.get` applies for every strategy. Idempotent."""
    # Each traced train step would otherwise keep its graph for the process's life (TF's
    # custom-gradient registry; see there): a notebook or a sweep training model after model.
    tf_custom_gradient.release_with_graph()
    # Every `fit` under a strategy would make a distributed iterator only to read one batch's
    # shapes and drop it live (a TF teardown race that segfaults now and then, and teardowns
    # that stalled later fits; see there): built from the specs instead. Wraps the trainer's current
    # `_maybe_symbolic_build`, so it must run after `keras_multi_worker.apply()` replaces it.
    keras_symbolic_build.keep_first_input_iterator()
    keras_symbolic_build.park_interrupted_inputs()
    # steps_per_execution > 1 crashes Keras's multi-step loop on 2+ replicas (see there).
    keras_steps_per_execution.run_executions_step_by_step()
    # Keras adds a (batch, 1) term along the channels when a replica's, copy's or micro-batch's
    # rows equal the channels (see there).
    keras_add.add_by_broadcasting()


def apply_strategy_fixes():
    """Applies every fix a Mirrored / MultiWorkerMirrored strategy needs. Idempotent.

    The one list `tfscale.strategies.get("mirrored" | "multi_worker")` and
    `tfscale-launch --keras_compat` apply; call it once, before `fit`, for a strategy you
    build yourself.

    Returns:
        {name: True if that fix is in effect, False if not needed here} for the five
        data-parallel fixes ("multi_worker", "optimizer", "loss", "batch_norm", "random_layers").
    """
    # `fit` under MWMS; also uneven per-replica batches under MirroredStrategy. First: it
    # replaces the trainer's `_maybe_symbolic_build`, which the iterator parking then wraps.
    applied = {"multi_worker": keras_multi_worker.apply()}
    applied["optimizer"] = keras_optimizer.apply()  # Clip after the all-reduce; accumulation.
    applied["loss"] = keras_loss_denominator.apply()  # Mean losses over the global batch.
    applied["batch_norm"] = keras_batch_norm.apply()  # BatchNormalization: the global batch's moments.
    applied["random_layers"] = keras_random_layers.apply()  # Dropout: one device's masks.
    apply_every_strategy_fixes()
    return applied
