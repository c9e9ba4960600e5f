"""The error type of tfscale.datasets."""

__all__ = ["DatasetError"]


class DatasetError(ValueError):
    """A dataset name, split or option that tfscale cannot serve (names the value and the fix)."""
