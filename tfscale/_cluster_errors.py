"""The error type of `tfscale.cluster`, in its own module so the parsers can raise it."""

from tfscale.errors import Error

__all__ = ["ClusterSpecError", "describe"]

_MAX_SHOWN = 80


class ClusterSpecError(Error):
    """A cluster description (TF_CONFIG, hosts, hostfile, Slurm or Kubernetes variables) is invalid."""


def describe(value):
    """`repr(value)` on one line, cut to a readable length (fuzzed input can be huge)."""
    try:
        text = repr(value)
    except RecursionError:  # deeply nested JSON
        text = f"<deeply nested {type(value).__name__}>"
    if len(text) > _MAX_SHOWN:
        text = text[: _MAX_SHOWN - 3] + "..."
    return text
