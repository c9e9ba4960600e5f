"""How a data-parallel strategy all-reduces gradients: compression and packing options.

`tfscale.strategies.get("mirrored" | "multi_worker", ...)` builds a `Communication`
from its options and attaches it to the strategy it returns; the optimizer fix in
`tfscale.compat.keras_optimizer` reads it back when Keras all-reduces gradients, so
the options reach the one all-reduce of every optimizer step (Keras itself passes
none). Hand-built strategies get the same with `configure(strategy, ...)`.
"""

import dataclasses

import tensorflow as tf

from tfscale import _strategy_spec as _spec
from tfscale.compat import keras_batch_norm, keras_loss_denominator, keras_random_layers, tf_communication
from tfscale.strategies._options import check

__all__ = ["COMPRESSIONS", "IMPLEMENTATIONS", "Communication", "configure", "of"]

# TensorFlow's dtype for each of `_spec.GRADIENT_COMPRESSIONS`, and its implementation for each
# of `_spec.COMMUNICATIONS` (the names and defaults are the spec's).
COMPRESSIONS = {None: None, "fp16": tf.float16, "bf16": tf.bfloat16}
IMPLEMENTATIONS = {
    "auto": tf.distribute.experimental.CommunicationImplementation.AUTO,
    "ring": tf.distribute.experimental.CommunicationImplementation.RING,
    "nccl": tf.distribute.experimental.CommunicationImplementation.NCCL,
}


@dataclasses.dataclass(frozen=True)
class Communication:
    """The gradient all-reduce of one strategy.

    Args:
        gradient_compression: None (all-reduce in the gradients' dtype), "fp16" or
            "bf16": gradients are cast to that dtype for the all-reduce and back after
            it. A sum that overflows fp16 is detected (the reduced values are the
            same on every replica, so every replica sees the same inf) and that
            step's all-reduce is redone in the gradients' own dtype.
        bytes_per_pack: 0 packs all gradients into one collective launch; N > 0
            splits them into packs of about N bytes, one launch each.
        timeout_seconds: None (wait forever) or seconds after which a collective
            fails instead of hanging.
        implementation: "auto", "ring" or "nccl" (collective implementation).

    Raises:
        StrategyError: a value outside the ranges above.
    """

    gradient_compression: str | None = _spec.MirroredOptions.gradient_compression
    bytes_per_pack: int = _spec.MirroredOptions.bytes_per_pack
    timeout_seconds: float | None = _spec.MirroredOptions.timeout_seconds
    implementation: str = _spec.MultiWorkerOptions.communication

    def __post_init__(self):
        if self.gradient_compression is not None:  # None: the gradients' own dtype
            check("gradient_compression", self.gradient_compression)
        check("bytes_per_pack", self.bytes_per_pack)
        if self.timeout_seconds is not None:
            check("timeout_seconds", self.timeout_seconds)
        check("communication", self.implementation, argument="implementation")

    @property
    def compression_dtype(self):
        """The dtype gradients travel in, or None for their own dtype."""
        return COMPRESSIONS[self.gradient_compression]

    def options(self):
        """These options as `tf.distribute.experimental.CommunicationOptions`."""
        return tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=int(self.bytes_per_pack),
            timeout_seconds=self.timeout_seconds,
            implementation=IMPLEMENTATIONS[self.implementation],
        )


def configure(strategy, **options):
    """Attaches gradient all-reduce options to a (hand-built) strategy; returns them.

    Args:
        strategy: a `tf.distribute.MirroredStrategy` or `MultiWorkerMirroredStrategy`.
        **options: the fields of `Communication`.

    Returns:
        The `Communication` now in effect for `strategy`.
    """
    communication = Communication(**options)
    tf_communication.attach(strategy, communication)
    return communication


def of(strategy):
    """The `Communication` attached to `strategy` (defaults if none was)."""
    return tf_communication.attached(strategy) or Communication()


def _other_launch(name):
    """Whether op `name` is the loss's, BatchNormalization's or Dropout's own launch, not a gradient's.

    A name scope entered again in one graph is made unique with a suffix (`..._1`).
    """
    scopes = (keras_loss_denominator.NAME_SCOPE, keras_batch_norm.NAME_SCOPE, keras_random_layers.NAME_SCOPE)
    return any(part == s or part.startswith(s + "_") for part in name.split("/") for s in scopes)


def traced_all_reduces(graph):
    """The gradient all-reduce launches in a traced step: `[(dtype, bytes), ...]`.

    Reads the `CollectiveReduceV2` ops of `graph` (e.g. the graph of a concrete
    `tf.function` that runs one training step under the strategy), one per replica
    per pack, with the size of the tensor each sends. Launches inside `tf.cond`
    branches (the fp16 overflow fallback) live in branch functions and are not
    counted: they run only on the steps that take that branch. Nor are the loss's own
    (a few scalars per loss term, `tfscale.compat.keras_loss_denominator`) and a trainable
    BatchNormalization's (its moments, `tfscale.compat.keras_batch_norm`), nor a random
    layer's (the replicas' row counts, `tfscale.compat.keras_random_layers`).
    """
    launches = []
    for op in graph.get_operations():
        if op.type == "CollectiveReduceV2" and not _other_launch(op.name):
            tensor = op.inputs[0]
            launches.append((tensor.dtype.name, tensor.shape.num_elements() * tensor.dtype.size))
    return launches
