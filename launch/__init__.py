"""tfscale.launch: local multi-process clusters and (soon) the supervising launcher."""

from tfscale.launch.local import ClusterRunError, TaskResult, run_local_cluster

__all__ = ["ClusterRunError", "TaskResult", "run_local_cluster"]
