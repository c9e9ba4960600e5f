"""The error types of tfscale.datasets."""

from tfscale.errors import Error

__all__ = ["DatasetError", "UnknownSplitError"]


class DatasetError(Error):
    """A dataset name, split or option that tfscale cannot serve (names the value and the fix)."""


class UnknownSplitError(DatasetError):
    """The dataset has no split of that name (callers that try several splits catch this one)."""
