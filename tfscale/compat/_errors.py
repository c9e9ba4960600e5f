"""The error a compat module raises when this Keras or TensorFlow lacks the private API it patches."""

from tfscale.errors import FAILED_RUN, Error

__all__ = ["UnsupportedVersionError"]


class UnsupportedVersionError(Error, RuntimeError):
    """This Keras/TensorFlow lacks a private API a compat module needs (still a `RuntimeError`).

    The input was fine; the installed version is outside the range the module was checked on,
    so the run fails (`FAILED_RUN`) instead of training differently.
    """

    exit_status = FAILED_RUN
