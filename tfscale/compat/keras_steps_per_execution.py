"""Keras + TensorFlow gap: `steps_per_execution > 1` crashes `fit`/`evaluate` on 2+ replicas.

Keras 3's TensorFlow trainer runs `steps_per_execution` steps in one `tf.function`: a
`tf.while_loop` over `iterator.get_next_as_optional()` whose body calls
`strategy.run(train_step)` inside a `tf.cond` (`TensorFlowTrainer._make_function`,
`multi_step_on_iterator`). Under `MirroredStrategy` with 2 or more replicas (TF 2.21,
Keras 3.15.1) the first execution fails: `InvalidArgumentError: You must feed a value
for placeholder tensor '.../while/cond/Placeholder' with dtype int32` ("0 derived errors
ignored", `Op:__inference_multi_step_on_iterator`). A replica function traced inside the
cond branch captures a tensor the branch never receives. One replica (`one_device`, plain
Keras) is not affected. A loop of our own with the same `tf.cond` around `strategy.run`
fails the same way (tried), so the cond is the cause, not Keras's `Optional` specs.

`run_executions_step_by_step()` makes such a trainer run each execution's steps one
after another from Python: `iterator.get_next_as_optional()`, and while it has a value,
Keras's own one-step `tf.function` (`one_step_on_data`) on it. Asking first matters: a
step function that calls `get_next()` past the end (tried) raises OutOfRangeError only
after its optimizer update has run, one extra Adam step per epoch. The steps, their
order, the batches and the callbacks' view (one `on_train_batch_end` per execution, as
Keras reports it) are unchanged, and so is the result: `steps_per_execution=2` and `3`
under `mirrored` give the one-device weights to 6e-8 (tests/test_equivalence.py; the
`steps_per_execution` cases of mirrored were strict xfails before). What is not kept:
the saving of host round trips that `steps_per_execution` exists for. On a multi-replica
strategy here the steps of one execution are separate calls, as with `1`.
Left alone: `TPUStrategy` (whose graph Keras's loop is written for, and where one call
per step would cost the most; not exercisable here) and `predict` (its own path works).

Checked on Keras 3.15.1 with TensorFlow 2.21.0 only.
Gate: `TensorFlowTrainer._make_function` and `._autoconvert_optionals` and the trainer
module's `reduce_per_replica` exist; otherwise nothing is changed.
FIXED_IN: none as of TF 2.21 / Keras 3.15.
"""

import functools
import threading

__all__ = ["CHECKED_ON", "FIXED_IN", "run_executions_step_by_step"]

CHECKED_ON = ("3.15.1", "2.21.0")
FIXED_IN = None
_lock = threading.Lock()


def run_executions_step_by_step():
    """Patches Keras's TF trainer as above; False (nothing changed) where the gate fails."""
    try:
        from keras.src.backend.tensorflow import trainer
    except ImportError:
        return False
    trainer_class = getattr(trainer, "TensorFlowTrainer", None)
    original = getattr(trainer_class, "_make_function", None)
    if not (
        callable(original)
        and callable(getattr(trainer_class, "_autoconvert_optionals", None))
        and callable(getattr(trainer, "reduce_per_replica", None))
    ):
        return False
    with _lock:
        if not getattr(trainer_class._make_function, "_tfscale_step_by_step", False):
            trainer_class._make_function = _step_by_step(original, trainer.reduce_per_replica)
    return True


def _affected(model):
    import tensorflow as tf

    strategy = getattr(model, "_distribute_strategy", None)
    if strategy is None or model.steps_per_execution == 1 or strategy.num_replicas_in_sync < 2:
        return False
    tpu = (tf.distribute.TPUStrategy, tf.distribute.experimental.TPUStrategy)
    return not isinstance(strategy, tpu)


def _step_by_step(original, reduce_per_replica):
    @functools.wraps(original)
    def _make_function(self, step_function):
        if not _affected(self):
            return original(self, step_function)
        import tensorflow as tf

        # Keras's own one-step function (TensorFlowTrainer._make_function, 3.15.1).
        @tf.autograph.experimental.do_not_convert
        def one_step_on_data(data):
            outputs = self.distribute_strategy.run(step_function, args=(data,))
            return reduce_per_replica(outputs, self.distribute_strategy, reduction="auto")

        if not self.run_eagerly:
            one_step_on_data = tf.function(
                one_step_on_data, reduce_retracing=True, jit_compile=self.jit_compile
            )
        one_step_on_data = self._autoconvert_optionals(one_step_on_data)

        steps = self.steps_per_execution

        def function(iterator):
            if not isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
                for _, data in zip(range(steps), iterator):
                    outputs = one_step_on_data(data)
                return outputs
            outputs = None
            for _ in range(steps):
                # Asked before the step, as Keras's own loop does: a step function that
                # calls get_next() past the end raises, but its stateful ops (the
                # optimizer's iteration count, Adam's moments) may already have run.
                data = iterator.get_next_as_optional()
                if not data.has_value():
                    break
                outputs = one_step_on_data(data.get_value())
            if outputs is None:
                raise StopIteration  # no step left in this epoch, as Keras's function says
            return outputs

        return function

    _make_function._tfscale_step_by_step = True
    return _make_function
