"""Keras 3 gap: a model compiled outside any strategy scope has no compiled-metric state until its first step.

Keras 3 (TensorFlow backend) builds the model's compiled metrics and
compiled loss before the first step only when the model was compiled under a
`tf.distribute` strategy (`TensorFlowTrainer._maybe_symbolic_build` returns at once when
`model._distribute_strategy is None`); otherwise it defers them to the trace of the
first train step, which also updates them. A mid-epoch resume must assign the
interrupted epoch's metric state before that step, so `build_compiled_metrics` builds
them first, the way Keras itself does under a strategy: `Trainer._symbolic_build` with
symbolic tensors of the input's element spec (shapes and dtypes only; no batch is read,
no random op is created, so the input order and the seeds stay those of an
uninterrupted run). No upstream issue asks for this (a deliberate deferral upstream).

Checked on Keras 3.15.1 with TensorFlow 2.21. Private names used:
`Trainer._symbolic_build(data_batch=...)`, `Trainer._compile_metrics` and
`Trainer._compile_loss` (each None or with `.built`). Gate: `supported(model)`; where it
is False, nothing is built and the resumed epoch's metrics cover only the steps run after
the restart (one log line). Test: tests/test_compat_backup.py.
"""

__all__ = ["CHECKED_ON", "build_compiled_metrics", "supported"]

CHECKED_ON = ("3.15.1", "3.15.1")


def supported(model):
    """The gate: every private name used here is present on `model`."""
    return callable(getattr(model, "_symbolic_build", None)) and all(
        hasattr(model, name) and (getattr(model, name) is None or hasattr(getattr(model, name), "built"))
        for name in ("_compile_metrics", "_compile_loss")
    )


def _unbuilt(model):
    return any(
        getattr(model, name) is not None and not getattr(model, name).built
        for name in ("_compile_metrics", "_compile_loss")
    )


def build_compiled_metrics(model, element_spec):
    """Builds the compiled metrics (and loss) of `model` from one batch's `element_spec`.

    Returns True if they are built (already, or now), False where this cannot (the gate
    is closed, or no element spec is known).
    """
    if not supported(model):
        return False
    if not _unbuilt(model):
        return True
    if element_spec is None:
        return False
    # A `tf.TensorSpec` has the `shape` and `dtype` Keras reads from a batch.
    model._symbolic_build(data_batch=element_spec)
    return not _unbuilt(model)
