"""Callback for learning-rate warmup with the linear scaling rule (Goyal et al. 2017)."""

import keras

from tfscale.callbacks._errors import CallbackError

__all__ = ["LearningRateWarmup"]


class LearningRateWarmup(keras.callbacks.Callback):
    """Callback to ramp the learning rate linearly, per step, and to scale it by replicas.

    "Accurate, Large Minibatch SGD" (Goyal et al. 2017): when the global batch grows k
    times (k replicas at a fixed per-replica batch), multiply the learning rate by k, and
    reach that rate gradually over the first epochs. At step t (0-based, the step about to
    run) the rate is `initial_lr + (target_lr - initial_lr) * min(1, (t + 1) / warmup_steps)`,
    with `target_lr = learning_rate * scale` and `initial_lr = learning_rate` (Goyal's
    choice) unless given. The step is read from `optimizer.iterations`, so a run resumed
    from a backup continues the ramp where it stopped. Works with or without a strategy.

    Args:
        learning_rate: the base (single-replica) learning rate.
        warmup_epochs: epochs to reach the target rate; 0 sets it from the first step.
        steps_per_epoch: optimizer steps per epoch.
        scale: multiplier of the target rate, usually `strategy.num_replicas_in_sync`.
        initial_lr: rate of the first step's ramp origin; default `learning_rate`
            (so with `scale=1` and a warmup, pass e.g. 0.0 to ramp up from zero).

    Raises:
        CallbackError: a rate, `scale` or `warmup_epochs` that is not a number in range, a
            `steps_per_epoch` that is not a positive integer.

    Example:

    >>> warmup = LearningRateWarmup(0.1, warmup_epochs=5, steps_per_epoch=100,
    ...                             scale=strategy.num_replicas_in_sync)
    >>> model.fit(ds, epochs=90, callbacks=[warmup])
    """

    def __init__(self, learning_rate, warmup_epochs, steps_per_epoch, scale=1, initial_lr=None):
        super().__init__()
        for name, value, may_be_zero in (
            ("learning_rate", learning_rate, False),
            ("warmup_epochs", warmup_epochs, True),
            ("scale", scale, False),
            ("initial_lr", 0.0 if initial_lr is None else initial_lr, True),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not value < float("inf")  # nan and inf too
                or value < 0.0
                or (not may_be_zero and value == 0.0)
            ):
                raise CallbackError(
                    f"Invalid value for argument `{name}`. Received: {name}={value!r}. Expected a "
                    f"{'non-negative' if may_be_zero else 'positive'} finite number."
                )
        if isinstance(steps_per_epoch, bool) or not isinstance(steps_per_epoch, int) or steps_per_epoch < 1:
            raise CallbackError(
                f"Invalid value for argument `steps_per_epoch`. Received: "
                f"steps_per_epoch={steps_per_epoch!r}. Expected a positive integer."
            )
        self.target_lr = float(learning_rate) * scale
        self.initial_lr = float(learning_rate if initial_lr is None else initial_lr)
        self.warmup_steps = max(1, round(warmup_epochs * steps_per_epoch)) if warmup_epochs else 0

    def learning_rate_at(self, step):
        """The learning rate this callback sets before 0-based step `step`."""
        if not self.warmup_steps or step + 1 >= self.warmup_steps:
            return self.target_lr
        return self.initial_lr + (self.target_lr - self.initial_lr) * (step + 1) / self.warmup_steps

    def _set(self):
        step = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.model.optimizer.learning_rate = self.learning_rate_at(step)

    def on_train_begin(self, logs=None):
        self._set()

    def on_train_batch_begin(self, batch, logs=None):
        if self.warmup_steps:
            self._set()

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["learning_rate"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
