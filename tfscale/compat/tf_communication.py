"""The all-reduce options of a tf.distribute strategy: its own, and those tfscale attaches.

Upstream gap: a `MirroredStrategy` / `MultiWorkerMirroredStrategy` keeps the
`CommunicationOptions` it was built with in `strategy.extended._communication_options`
(private; no public getter), and has nowhere to hold gradient compression. tfscale's
strategies (`tfscale.strategies.configure_communication`, `get("mirrored", ...)`) attach a
`Communication` under `ATTRIBUTE`; the optimizer fix (`keras_optimizer`) and the
`CommunicationProfiler` read it back here, so neither imports the strategies (a layer above).
The attached object gives `compression_dtype` (None or a dtype) and `options()` (its
`CommunicationOptions`).

Checked on TensorFlow 2.16-2.21 (`_communication_options` exists on both strategies' `extended`).
Gate: `tests/test_communication.py` fails when the attribute changes name or meaning
(packing options then no longer reach the traced all-reduce).
"""

__all__ = ["ATTRIBUTE", "attach", "attached", "compression_dtype", "options"]

ATTRIBUTE = "_tfscale_communication"


def attach(strategy, communication):
    """Attaches `communication` (a `tfscale.strategies.Communication`) to `strategy`."""
    setattr(strategy, ATTRIBUTE, communication)


def attached(strategy):
    """The `Communication` attached to `strategy`, or None (tfscale's defaults apply)."""
    return getattr(strategy, ATTRIBUTE, None)


def compression_dtype(strategy):
    """The dtype `strategy`'s gradients travel in, or None for their own dtype."""
    communication = attached(strategy)
    return None if communication is None else communication.compression_dtype


def options(strategy):
    """`strategy`'s own `CommunicationOptions` with the attached ones merged over them.

    With nothing attached it is a copy of the strategy's own (`merge(None)`), which is what
    merging tfscale's defaults (pack 0, no timeout, AUTO: what `merge` skips) gives too.
    """
    communication = attached(strategy)
    return strategy.extended._communication_options.merge(
        None if communication is None else communication.options()
    )
