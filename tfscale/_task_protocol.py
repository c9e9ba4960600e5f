"""What the launcher and a training task agree on, owned below both of them.

`tfscale.launch` (a capability) and `tfscale-train` (a binary) both need these facts;
keeping them here lets the launcher read them without importing the binary above it.
"""

import os

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE", "RESTART_COUNT_VAR", "restart_count"]

DEFAULT_GLOBAL_BATCH_SIZE = 64  # what `--global_batch_size` means when neither batch flag is given
# The launcher sets it in every task: 0 in the first attempt, n after n restarts (torchrun's
# TORCHELASTIC_RESTART_COUNT); unset when the task was not started by `tfscale-launch`.
RESTART_COUNT_VAR = "TFSCALE_RESTART_COUNT"


def restart_count(environ=None):
    """This task's attempt: the launcher's `TFSCALE_RESTART_COUNT` (0 when unset)."""
    return int((os.environ if environ is None else environ).get(RESTART_COUNT_VAR, "0"))
