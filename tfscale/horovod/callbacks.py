"""Horovod's Keras callbacks: broadcast the start, average the metrics, warm up and schedule the LR.

Each rank runs its own `fit`; these callbacks are what keeps the ranks one job.
"""

import keras
import numpy as np

from tfscale.horovod import _basics, _collective
from tfscale.horovod._errors import HorovodError
from tfscale.horovod._missing import missing_attribute

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
]


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Callback to start every rank from rank `root_rank`'s weights and optimizer state.

    Broadcasts at the start of `fit` (building the optimizer first, as `fit` would at its
    first step), so the first step already runs on the same weights and optimizer state
    everywhere (Horovod broadcasts after the first batch); if the model was not built by
    then, after the first batch.

    Args:
        root_rank: the rank whose variables every rank takes.
        device: Horovod's placement hint; only "".
    """

    def __init__(self, root_rank, device=""):
        super().__init__()
        if device:
            raise HorovodError(
                f"Invalid value for argument `device`. Received: device={device!r}. Expected ''."
            )
        self.root_rank = _collective._check_root(root_rank)
        self._pending = True

    def _broadcast(self):
        optimizer = self.model.optimizer
        if optimizer is not None and not optimizer.built and self.model.built:
            optimizer.build(self.model.trainable_variables)  # what `fit` does at its first step
        variables = list(self.model.variables)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
        _collective.broadcast_variables(variables, self.root_rank)
        return optimizer is None or optimizer.built

    def on_train_begin(self, logs=None):
        self._pending = not self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if self._pending:
            self._pending = not self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Callback to replace each epoch's metrics (`logs`) by their mean over ranks.

    Callbacks after it in the list, and `History`, see the averages.

    Args:
        device: Horovod's placement hint; only "".
    """

    def __init__(self, device=""):
        super().__init__()
        if device:
            raise HorovodError(
                f"Invalid value for argument `device`. Received: device={device!r}. Expected ''."
            )

    def on_epoch_end(self, epoch, logs=None):
        if not logs:
            return
        names = sorted(logs)
        values = np.array([float(logs[n]) for n in names], np.float64)
        averaged = _collective.allreduce(values, op=_collective.Average, name="metrics").numpy()
        for name, value in zip(names, averaged):
            logs[name] = float(value)


def _set_learning_rate(optimizer, value):
    if isinstance(optimizer.learning_rate, keras.optimizers.schedules.LearningRateSchedule) or callable(
        getattr(optimizer, "_learning_rate", None)
    ):
        raise HorovodError(
            "The optimizer's learning rate is a schedule. Expected a float learning rate for the "
            "hvd LR callbacks to set."
        )
    old = float(optimizer.learning_rate)
    optimizer.learning_rate = value
    return old


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Callback to set `lr = initial_lr * multiplier(epoch)` from `start_epoch` to `end_epoch`.

    Args:
        initial_lr: the base learning rate.
        multiplier: a number, or a function of the (fractional) epoch.
        start_epoch: first epoch it acts in.
        end_epoch: epoch it stops before (None: to the end).
        staircase: set once per epoch (True) or at every batch with a fractional epoch.
        momentum_correction: when the rate changes, scale SGD's momentum buffers by
            new/old rate, as Horovod scales the momentum for that step.
        steps_per_epoch: batches per epoch (default: what `fit` reports).
        verbose: print the rate at each epoch start.
    """

    def __init__(
        self,
        initial_lr,
        multiplier,
        start_epoch=0,
        end_epoch=None,
        staircase=True,
        momentum_correction=True,
        steps_per_epoch=None,
        verbose=0,
    ):
        super().__init__()
        if isinstance(initial_lr, bool) or not isinstance(initial_lr, (int, float)) or initial_lr <= 0:
            raise HorovodError(
                f"Invalid value for argument `initial_lr`. Received: initial_lr={initial_lr!r}. "
                "Expected a positive number."
            )
        self.initial_lr = float(initial_lr)
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch, m=float(multiplier): m)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch, self.verbose = steps_per_epoch, verbose
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps")
        if not self.staircase and not self.steps_per_epoch:
            raise HorovodError(
                "Argument `steps_per_epoch` is needed with staircase=False and a dataset of unknown "
                "length. Expected the number of batches per epoch."
            )

    def _active(self, epoch):
        return self.start_epoch <= epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _adjust(self, epoch):
        new = self.initial_lr * self.multiplier(epoch)
        optimizer = self.model.optimizer
        old = _set_learning_rate(optimizer, new)
        momentums = getattr(optimizer, "momentums", None)
        if self.momentum_correction and momentums and old > 0 and new != old:
            for m in momentums:  # SGD: m = momentum * m - lr * g; this keeps Horovod's step
                m.assign(m * (new / old))

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._active(epoch) and self.staircase:
            self._adjust(epoch)
            if self.verbose and _basics.rank() == 0:
                print(f"Epoch {epoch + 1}: learning rate {float(self.model.optimizer.learning_rate):g}")

    def on_train_batch_begin(self, batch, logs=None):
        if self.staircase or not self._active(self._epoch):
            return
        self._adjust(self._epoch + batch / self.steps_per_epoch)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Callback to ramp the learning rate from `initial_lr / size()` to `initial_lr` over `warmup_epochs`.

    Horovod's rule (Goyal et al., 2017): at fractional epoch e the rate is
    `initial_lr / size * (e * (size - 1) / warmup_epochs + 1)`, set at every batch.

    Args:
        initial_lr: the rate after warm-up (usually base rate x size()).
        warmup_epochs: epochs the ramp lasts.
        momentum_correction, steps_per_epoch, verbose: as for
            `LearningRateScheduleCallback`.
    """

    def __init__(
        self, initial_lr, warmup_epochs=5, momentum_correction=True, steps_per_epoch=None, verbose=0
    ):
        def multiplier(epoch):
            size = _basics.size()
            epoch += 1.0 / self.steps_per_epoch
            return 1.0 / size * (epoch * (size - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=False,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
            verbose=verbose,
        )
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.end_epoch - 1 and self.verbose and _basics.rank() == 0:
            print(f"Epoch {epoch + 1}: finished gradual learning rate warmup to {self.initial_lr:g}.")


def __getattr__(name):
    return missing_attribute(__name__, name)
