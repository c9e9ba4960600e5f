"""Splitting the host CPU into logical devices so data parallelism runs without GPUs."""

import tensorflow as tf

from tfscale.strategies._errors import StrategyError

__all__ = ["cpu_device_names", "split_cpu"]


def split_cpu(num_devices):
    """Makes at least `num_devices` logical CPU devices available.

    TensorFlow fixes its logical devices when the runtime initializes (at the
    first op). Before that, the host CPU is split into exactly `num_devices`
    logical devices. After that, an existing split of at least `num_devices`
    is reused (its first `num_devices` devices serve); anything smaller is an
    error, because it can no longer be changed in this process.

    Args:
        num_devices: how many logical CPU devices are needed (>= 1).

    Returns:
        The names of the first `num_devices` logical CPU devices.

    Raises:
        StrategyError: `num_devices` is not a positive integer, or the runtime
            is already initialized with fewer logical CPU devices.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise StrategyError(
            f"Invalid value for argument `cpu_replicas`. Received: "
            f"cpu_replicas={num_devices!r}. Expected a positive integer."
        )
    physical = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(physical)
    have = len(current) if current else 1
    if have >= num_devices and (current or num_devices == 1):
        return cpu_device_names(num_devices)
    try:
        tf.config.set_logical_device_configuration(
            physical, [tf.config.LogicalDeviceConfiguration() for _ in range(num_devices)]
        )
    except RuntimeError:
        raise StrategyError(
            f"`cpu_replicas={num_devices}` needs {num_devices} logical CPU devices, but "
            f"TensorFlow is already initialized with {have} in this process and the split "
            "cannot change any more. Create the strategy (or call "
            f"tfscale.strategies.split_cpu({num_devices})) before the first TensorFlow op."
        ) from None
    return cpu_device_names(num_devices)


def cpu_device_names(num_devices):
    """Returns the local logical CPU device names `/device:CPU:0..num_devices-1`."""
    return [f"/device:CPU:{i}" for i in range(num_devices)]


def parse_device(device, argument="device"):
    """Canonical '/device:TYPE:i' for a device name, or `StrategyError` naming `argument`."""
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError):
        spec = None
    if spec is None or spec.device_type is None:
        raise StrategyError(
            f"Invalid value for argument `{argument}`. Received: {argument}={device!r}. "
            "Expected a device name such as '/cpu:0' or '/gpu:1'."
        )
    return f"/device:{spec.device_type.upper()}:{spec.device_index or 0}"


def first_devices(count, argument):
    """The first `count` GPUs if any GPU is visible, else `count` logical CPU devices.

    Args:
        count: how many devices (stages, parts) are needed.
        argument: the user's argument that asked for them, named in errors.

    Raises:
        StrategyError: too few GPUs, or TensorFlow already started with fewer CPU devices.
    """
    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        if count > len(gpus):
            raise StrategyError(
                f"Invalid value for argument `{argument}`. Received: {argument}={count}. "
                f"Expected at most the {len(gpus)} GPU(s) visible here."
            )
        return [d.name for d in gpus[:count]]
    try:
        return split_cpu(count)
    except StrategyError:
        have = len(tf.config.list_logical_devices("CPU"))
        raise StrategyError(
            f"Invalid value for argument `{argument}`. Received: {argument}={count}, more than the "
            f"{have} logical CPU device(s) here (TensorFlow has started, so the host CPU cannot be "
            f"split further). Expected at most {have}, or call tfscale.strategies.split_cpu({count}) "
            "before the first TensorFlow op."
        ) from None
