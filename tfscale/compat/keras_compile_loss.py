"""The compiled loss of one micro-batch, and the "loss" metric, for a pipelined `train_step`.

Upstream gap: Keras 3 has no public hook to compute the compiled loss *without*
`model.losses`, nor to update the "loss" metric the way `Model.train_step` does.
`Model.compute_loss` adds `model.losses` (weight regularisation) once per call: a pipeline
calling it per micro-batch would add it M times, and differentiate it on the last stage's
device, where the other stages' variables do not live. So:

- `model._compile_loss(y, y_pred, sample_weight)`: the `CompileLoss` built by `compile`;
- `model._loss_tracker`: the `Mean` behind the "loss" log, updated as
  `keras/src/backend/tensorflow/trainer.py::train_step` does.

Checked on Keras 3.15.1 / TensorFlow 2.21 (both attributes exist in Keras 3.0-3.15).
Gate: `available(model)`; `tests/test_compat_strategies.py` fails when either attribute
changes name or meaning.
"""

from tfscale.compat._errors import UnsupportedVersionError

__all__ = ["available", "compiled_loss", "update_loss_tracker"]


def available(model):
    """True when a compiled `model` has both private attributes this module reads."""
    return hasattr(model, "_compile_loss") and hasattr(model, "_loss_tracker")


def compiled_loss(model):
    """The `CompileLoss` of a compiled model (None if compiled without `loss`)."""
    if not available(model):
        raise UnsupportedVersionError(
            "This Keras version has no `Model._compile_loss` / `_loss_tracker` (checked on "
            "Keras 3.0-3.15); tfscale.compat.keras_compile_loss needs updating."
        )
    return model._compile_loss


def update_loss_tracker(model, loss, batch_size):
    """Updates the "loss" metric exactly like Keras's own TF `train_step`."""
    model._loss_tracker.update_state(loss, sample_weight=batch_size)
