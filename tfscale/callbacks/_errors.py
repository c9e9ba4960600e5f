"""The error type of the tfscale callbacks that are not backups (those raise `BackupError`)."""

from tfscale.errors import Error

__all__ = ["CallbackError"]


class CallbackError(Error):
    """A callback argument tfscale cannot honour (names the argument, the value and what was expected)."""
