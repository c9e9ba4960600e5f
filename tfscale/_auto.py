"""The rule of `strategies.get("auto")` on plain values, without TensorFlow.

`strategies.get("auto")` feeds it what TensorFlow sees (TPUs, GPUs); `tfscale.flags`
feeds it what the flags say, to check a batch size before TensorFlow starts. One rule,
so the prediction cannot drift from the choice.
"""

__all__ = ["TPU_ENV_VARS", "choose", "tpu_named"]

TPU_ENV_VARS = ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS")


def tpu_named(tpu, environ):
    """True when a TPU is named by the `tpu` option or by the environment."""
    return tpu is not None or any(environ.get(v) for v in TPU_ENV_VARS)


def choose(*, tpu, num_workers, gpus, cpu_replicas):
    """The strategy "auto" picks, and why (for the log line).

    Args:
        tpu: a TPU is named or visible.
        num_workers: workers of this task's cluster (`ClusterSpec.num_workers`).
        gpus: GPUs visible to this process.
        cpu_replicas: the `cpu_replicas` option, or None.

    Returns:
        `(name, reason)`, name one of "tpu", "multi_worker", "mirrored", "one_device".
    """
    if tpu:
        return "tpu", "a TPU is named or visible"
    if num_workers > 1:
        return "multi_worker", f"the cluster has {num_workers} workers"
    if gpus > 1:
        return "mirrored", f"{gpus} GPUs visible"
    if cpu_replicas and cpu_replicas > 1:
        return "mirrored", f"over {cpu_replicas} logical CPU devices (cpu_replicas)"
    return "one_device", "no TPU, no multi-worker cluster, <2 GPUs"
