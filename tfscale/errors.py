"""`tfscale.Error`: the one base of every error tfscale raises.

Every domain error (`ClusterSpecError`, `StrategyError`, `DatasetError`, ...) derives
from it and stays a `ValueError`, so `except tfscale.Error` catches anything tfscale
reports and `except ValueError` keeps working. The binaries catch this base alone:
one line `<prog>: error: ...` on stderr and exit status `exit_status`, never a
traceback. Callers branch on these types, never on message text.
"""

import sys

__all__ = ["BAD_INPUT", "FAILED_RUN", "Error", "LaunchError", "first_line", "report"]

BAD_INPUT = 2  # a flag, a TF_CONFIG, a hostfile, an option: what `absl` and argparse exit with
FAILED_RUN = 1  # the input was fine, the run was not (a task died, a backup dir is torn)


class Error(ValueError):
    """The base of every tfscale error: a one-line message naming the value and what was expected.

    Attributes:
        exit_status: what a tfscale binary exits with when this error ends it:
            `BAD_INPUT` (2) unless a subclass says the run itself failed (1).
    """

    exit_status = BAD_INPUT


class LaunchError(Error):
    """Bad input to the launcher (a flag, a host list, a command that cannot start) or to
    the launcher <-> task protocol (an elastic batch that does not split); defined here,
    below both, and re-exported by `tfscale.launch.supervisor`."""


def first_line(error):
    """The first line of `error`'s message (its type's name if it has none)."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


def report(prog, error, file=None):
    """Prints `<prog>: error: <first line>` on stderr; returns the exit status for `error`.

    `error` is a `tfscale.Error` (its class says bad input or a failed run; its first line
    is printed) or an absl flags error or text (bad input; printed whole, newlines escaped).
    """
    if isinstance(error, Error):
        text = first_line(error)
    else:
        # absl quotes a flag's value as given: a newline in the value must not start a second line.
        text = str(error).strip().replace("\r", "\\r").replace("\n", "\\n") or type(error).__name__
    print(f"{prog}: error: {text}", file=sys.stderr if file is None else file)
    return getattr(type(error), "exit_status", BAD_INPUT)
