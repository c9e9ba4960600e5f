"""The error type of tfscale.horovod."""

from tfscale.errors import Error

__all__ = ["HorovodError"]


class HorovodError(Error):
    """A Horovod call tfscale cannot honour: bad argument, no `init()`, ranks that disagree."""
