"""Devices for every strategy: naming, discovery, the CPU split, and resolving a user's list.

One owner for "which devices": the pipeline's stages and model split's parts ask
`resolve_devices`, the data-parallel strategies `split_cpu` / `parse_device`.

Discovery never starts TensorFlow's runtime: it reads the physical devices and their
logical configuration (`tf.config.list_physical_devices` does not initialise the runtime;
`list_logical_devices` does, after which the host CPU can no longer be split). So a fresh
process can create a pipeline or model-split strategy on CPU with default devices.
"""

import tensorflow as tf

from tfscale.compat import tf_custom_gradient
from tfscale.strategies._errors import StrategyError
from tfscale.strategies._options import check

__all__ = [
    "available_devices",
    "cpu_device_names",
    "device_key",
    "device_type",
    "first_devices",
    "local_device_names",
    "parse_device",
    "resolve_devices",
    "split_cpu",
    "use_cluster",
]

# Set by `use_cluster` once this process drives a cluster's devices (`_remote.connect`):
# this task's own (job, (replica, task)), keyed as local, and every device of the cluster.
_cluster = {"task": None, "devices": ()}


def use_cluster(task, devices):
    """Records that this process is task `task` ((job, replica, task)) driving `devices`.

    From then on this task's own devices key as local (so '/cpu:0' and
    '/job:worker/replica:0/task:0/device:CPU:0' name one device on the client), a remote
    name must be one of `devices`, and the default devices are the cluster's, task by task.
    """
    job, replica, index = task
    _cluster["task"] = (job, (replica, index))
    _cluster["devices"] = tuple(devices)


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
    check("cpu_replicas", num_devices)
    # As strategies.get does (see there); here too because a process that splits its CPU
    # (the test suite, the CPU examples) often trains plain Keras models before any get().
    tf_custom_gradient.release_with_graph()
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
    key = device_key(device) if isinstance(device, str) else None
    if key is None:
        raise StrategyError(
            f"Invalid value for argument `{argument}`. Received: {argument}={device!r}. "
            "Expected a device name such as '/cpu:0' or '/gpu:1'."
        )
    return f"/device:{key[2]}:{key[3]}"


def device_key(device):
    """A comparable key for a device name (None if it is not one): job, task, type, index.

    A local name (no job, or job "localhost") keys as the same device however it is spelled
    ('/cpu:0', '/device:CPU:0', '/job:localhost/replica:0/task:0/device:CPU:0').
    """
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (ValueError, TypeError):
        return None
    if spec.device_type is None:
        return None
    job = None if spec.job in (None, "localhost") else spec.job
    task = (spec.replica or 0, spec.task or 0) if job else (0, 0)
    if job and (job, task) == _cluster["task"]:
        job, task = None, (0, 0)  # The client's own task: its devices are local ones.
    return job, task, spec.device_type.upper(), spec.device_index or 0


def device_type(device):
    """'CPU', 'GPU', ... of a device name (None if it is not one)."""
    key = device_key(device)
    return None if key is None else key[2]


def local_device_names(kind):
    """The local logical devices of one type ('CPU', 'GPU'), without starting the runtime.

    Counts each visible physical device's logical configuration (one logical device when
    it has none), which is what the runtime creates when it starts.
    """
    names = []
    for physical in tf.config.get_visible_devices(kind):
        configured = tf.config.get_logical_device_configuration(physical)
        names += [None] * (len(configured) if configured else 1)
    return [f"/device:{kind}:{i}" for i in range(len(names))]


def _canonical(device, argument):
    """'/device:TYPE:i' for a local name; a remote task's name is kept whole."""
    local = parse_device(device, argument)
    return tf.DeviceSpec.from_string(device).to_string() if device_key(device)[0] else local


def available_devices():
    """The devices the default placement draws from: the cluster's when this process drives
    one (GPUs if any task has one, else CPUs, task by task), else this process's."""
    devices = _cluster["devices"]
    if devices:
        gpus = [d for d in devices if device_type(d) == "GPU"]
        return gpus or [d for d in devices if device_type(d) == "CPU"]
    return local_device_names("GPU") or local_device_names("CPU")


def _remote_devices():
    """Every device this process can place on (starts the runtime: only for remote names)."""
    if _cluster["devices"]:
        return list(_cluster["devices"])
    return [d.name for d in tf.config.list_logical_devices()]


def _check_remote(name, given):
    known = _remote_devices()
    if device_key(name) in {device_key(d) for d in known}:
        return
    spec = tf.DeviceSpec.from_string(name)
    tasks = {(tf.DeviceSpec.from_string(d).job, tf.DeviceSpec.from_string(d).task) for d in known}
    why = (
        f"task {spec.job}:{spec.task or 0} has no {spec.device_type}:{spec.device_index or 0}"
        if (spec.job, spec.task or 0) in tasks
        else f"task {spec.job}:{spec.task or 0} is not in the cluster this process is connected to"
    )
    remote = [d for d in known if d.startswith("/job:") and not d.startswith("/job:localhost")]
    raise StrategyError(
        f"Invalid value for argument `devices`. Received: device {given!r}, but {why}. Expected "
        f"names from {remote or known} (connect first: tfscale.strategies.connect_cluster(cluster))."
    )


def resolve_devices(devices, count, *, count_argument, distinct):
    """The device of each part (pipeline stage, model-split part), checked.

    Args:
        devices: the user's list of device names, or None for the first `count` devices
            (`first_devices`).
        count: how many parts, or None to take `len(devices)`.
        count_argument: the user's argument that gave `count`, named in errors.
        distinct: whether every part needs its own device (model split); a pipeline may
            place several stages on one device.

    Returns:
        Canonical names ('/device:CPU:1'; a remote task's name kept whole), one per part.

    Raises:
        StrategyError: not a list of names, the wrong length, a repeated device where
            `distinct`, or a local device that does not exist here.
    """
    if devices is None:
        return first_devices(_positive(count, count_argument), count_argument)
    if isinstance(devices, str) or not isinstance(devices, (list, tuple)) or not devices:
        raise StrategyError(
            f"Invalid value for argument `devices`. Received: devices={devices!r}. Expected a "
            "non-empty list of device names."
        )
    if count is not None and len(devices) != count:
        raise StrategyError(
            f"Invalid value for argument `devices`. Received: devices={list(devices)!r}. Expected a "
            f"list of {count} device names (one per part, {count_argument}={count})."
        )
    names = [_canonical(d, "devices") for d in devices]
    if distinct and len(set(names)) != len(names):
        raise StrategyError(
            f"Invalid value for argument `devices`. Received: devices={list(devices)!r}. Expected "
            "distinct devices, one per part."
        )
    for name, given in zip(names, devices):
        if name.startswith("/job:"):
            _check_remote(name, given)
            continue
        kind = device_type(name)
        known = local_device_names(kind)
        if name not in known:
            raise StrategyError(
                f"Invalid value for argument `devices`. Received: device {given!r}, which does not "
                f"exist here. Expected names from {known or ['/device:CPU:0']}."
            )
    return names


def _positive(value, argument):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise StrategyError(
            f"Invalid value for argument `{argument}`. Received: {argument}={value!r}. Expected a "
            "positive integer (or pass `devices`)."
        )
    return value


def first_devices(count, argument):
    """The first `count` GPUs if any GPU is visible, else `count` logical CPU devices.

    Args:
        count: how many devices (stages, parts) are needed.
        argument: the user's argument that asked for them, named in errors.

    Raises:
        StrategyError: too few GPUs, or TensorFlow already started with fewer CPU devices.
    """
    if _cluster["devices"]:
        devices = available_devices()
        if count > len(devices):
            raise StrategyError(
                f"Invalid value for argument `{argument}`. Received: {argument}={count}, more than the "
                f"{len(devices)} {device_type(devices[0])} device(s) of the cluster ({devices}). "
                f"Expected at most {len(devices)}."
            )
        return [_canonical(d, argument) for d in devices[:count]]
    # Physical devices: asking for logical ones would start the runtime, and the host CPU
    # could then no longer be split below.
    gpus = local_device_names("GPU")
    if gpus:
        if count > len(gpus):
            raise StrategyError(
                f"Invalid value for argument `{argument}`. Received: {argument}={count}. "
                f"Expected at most the {len(gpus)} GPU(s) visible here."
            )
        return gpus[:count]
    try:
        return split_cpu(count)
    except StrategyError:
        have = len(local_device_names("CPU"))
        raise StrategyError(
            f"Invalid value for argument `{argument}`. Received: {argument}={count}, more than the "
            f"{have} logical CPU device(s) here (TensorFlow has started, so the host CPU cannot be "
            f"split further). Expected at most {have}, or call tfscale.strategies.split_cpu({count}) "
            "before the first TensorFlow op."
        ) from None
