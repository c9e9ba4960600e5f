"""The interrupted epoch's metric state: saved with each backup, put back after Keras resets it.

`fit` resets every metric of the model (`Model.reset_metrics`: the loss tracker, the
compiled metrics, the model's own) at the start of each epoch, just before
`on_epoch_begin`. A mid-epoch resume starts the interrupted epoch afresh, so without
this its logged loss and metrics would cover only the steps run after the restart. The
backup holds `model.metrics_variables` (public Keras API) beside the weights; a
mid-epoch restore assigns them in `on_epoch_begin` of the resumed epoch, after that
reset, and the epoch ends with the metrics of all its steps, as if uninterrupted. A model
compiled outside any strategy scope has its compiled metrics built there first
(`tfscale.compat.keras_metrics_build`: Keras would build them only in the first step).

Under a `tf.distribute` strategy metric variables are sync-on-read: reading one outside
a replica gives the aggregate over the replicas (a sum for Keras's metrics), and
assigning one there spreads the value so that the aggregate reads back the same
(`tf.distribute`'s own rule for restoring a checkpoint: each replica gets value / N).
"""

import logging

from tfscale.compat import keras_metrics_build

__all__ = ["PendingMetrics", "metric_variables", "signature_matches"]

_log = logging.getLogger("tfscale")


def metric_variables(model):
    """The state of every metric `fit` resets at an epoch's start, in `model.metrics` order."""
    return list(model.metrics_variables)


def signature_matches(signature, variables, structural_name):
    """Whether `signature` (`[[path, shape, dtype], ...]`) describes `variables`."""
    return len(signature) == len(variables) and all(
        shape == list(v.shape) and dtype == str(v.dtype) and structural_name(name) == structural_name(v.path)
        for (name, shape, dtype), v in zip(signature, variables)
    )


class PendingMetrics:
    """Metric values of a mid-epoch backup, to assign once the resumed epoch has begun.

    Args:
        epoch: the epoch the backup interrupted (the one `fit` resumes).
        signature: the backup's `metric_variables` entry.
        values: their values (host arrays), in the same order.
        structural_name: how variable paths compare across processes.
    """

    def __init__(self, epoch, signature, values, structural_name):
        self.epoch, self.signature, self.values = epoch, signature, values
        self._structural_name = structural_name

    def restore(self, model, epoch, element_spec=None):
        """Assigns the values if `epoch` is the interrupted one; True once that is done.

        `element_spec`: one input batch's spec, to build compiled metrics that Keras
        would build only at the first step (a model compiled outside any strategy
        scope; `keras_metrics_build`). Metrics that still differ from the backup's
        (another `compile`) are left as Keras has them, with one log line: that
        epoch's metrics then cover only the steps run after the restart, as before.
        """
        if epoch != self.epoch:
            return False
        variables = metric_variables(model)
        if not signature_matches(self.signature, variables, self._structural_name):
            keras_metrics_build.build_compiled_metrics(model, element_spec)
            variables = metric_variables(model)
        if not signature_matches(self.signature, variables, self._structural_name):
            _log.warning(
                "tfscale: the metrics of epoch %d are not restored (the backup holds %d metric "
                "variables, this model %d with other names or shapes): that epoch's logged "
                "metrics cover only the steps run after the restart",
                epoch,
                len(self.signature),
                len(variables),
            )
            return True
        for v, value in zip(variables, self.values, strict=True):
            v.assign(value)
        return True
