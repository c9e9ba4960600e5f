"""tfscale.launch: local multi-process clusters and the supervising launcher (`tfscale-launch`)."""

from tfscale.launch.jobs import HostsJob, LocalJob, SlurmJob
from tfscale.launch.local import ClusterRunError, TaskResult, run_local_cluster
from tfscale.launch.supervisor import Failure, LaunchError, LaunchResult, Supervisor, TaskSpec, launch

__all__ = [
    "ClusterRunError",
    "Failure",
    "HostsJob",
    "LaunchError",
    "LaunchResult",
    "LocalJob",
    "SlurmJob",
    "Supervisor",
    "TaskResult",
    "TaskSpec",
    "launch",
    "run_local_cluster",
]
