"""Drop-in Keras callbacks for training that scales and survives faults."""

from tfscale.callbacks._elastic_backup import ElasticBackupAndRestore
from tfscale.callbacks._errors import CallbackError
from tfscale.callbacks.backup_and_restore import (
    RESTART_EXIT_CODE,
    BackupAndRestore,
    BackupError,
    BackupInUseError,
    BackupMismatchError,
    BackupWriteError,
    UnusableBackupError,
)
from tfscale.callbacks.communication_profiler import CommunicationProfiler
from tfscale.callbacks.fail_at import FailAt, InjectedFault
from tfscale.callbacks.lr_warmup import LearningRateWarmup
from tfscale.callbacks.step_timer import StepTimer

__all__ = [
    "RESTART_EXIT_CODE",
    "BackupAndRestore",
    "BackupError",
    "BackupInUseError",
    "BackupMismatchError",
    "BackupWriteError",
    "CallbackError",
    "CommunicationProfiler",
    "ElasticBackupAndRestore",
    "FailAt",
    "InjectedFault",
    "LearningRateWarmup",
    "StepTimer",
    "UnusableBackupError",
]
