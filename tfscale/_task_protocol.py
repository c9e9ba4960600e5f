"""What the launcher and a training task agree on, owned below both of them.

`tfscale.launch` (a capability) and `tfscale-train` (a binary) both need these facts;
keeping them here lets the launcher read them without importing the binary above it.
"""

import os

__all__ = ["DEFAULT_GLOBAL_BATCH_SIZE", "JOB_ID_VAR", "RESTART_COUNT_VAR", "TF_CONFIG_VAR", "restart_count"]

DEFAULT_GLOBAL_BATCH_SIZE = 64  # what `--global_batch_size` means when neither batch flag is given
# The launcher sets it in every task: 0 in the first attempt, n after n restarts (torchrun's
# TORCHELASTIC_RESTART_COUNT); unset when the task was not started by `tfscale-launch`.
RESTART_COUNT_VAR = "TFSCALE_RESTART_COUNT"
# The launcher sets it in every task: one id per job, the same across restarts (launch/jobs.py);
# BackupAndRestore keeps it in each backup and refuses another job's backup folder.
JOB_ID_VAR = "TFSCALE_JOB_ID"
# TensorFlow's cluster description of a task (read by tfscale.cluster, written by the launcher).
TF_CONFIG_VAR = "TF_CONFIG"


def restart_count(environ=None):
    """This task's attempt: the launcher's `TFSCALE_RESTART_COUNT` (0 when unset)."""
    return int((os.environ if environ is None else environ).get(RESTART_COUNT_VAR, "0"))
