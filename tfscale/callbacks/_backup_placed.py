"""Backup shards of the variables of another task, written and verified on that task.

A variable created under `tf.device("/job:worker/replica:0/task:1/...")` by a client
connected with `tf.config.experimental_connect_to_cluster` lives in task 1's memory.
Gathering it into the writer's process would move every byte over the network and hold
it there; instead every op of its shard is placed on the task that holds it:

- snapshot: the task serializes its variables into one string tensor that stays in its
  memory (the copy the next steps cannot change);
- write: the same task fingerprints the string (`Fingerprint`, farmhash64) and writes it
  (`WriteFile`) into the backup's temporary directory; only the 8-byte fingerprint and the
  size come back to the client, which publishes the directory by rename as for any shard;
- restore: the task reads the file, fingerprints it and parses it; the client compares
  the fingerprint with the manifest (every shard before any assignment) and assigns the
  parsed tensors, which are still on that task, to the variables there.

`WriteFile` closes the file but does not fsync it: a host that crashes right after a
backup may lose that shard, which the fingerprint then rejects on restore (the previous
backup is used). farmhash64 catches corruption, not tampering (the `.npz` shards use
sha256).
"""

import tensorflow as tf

from tfscale.callbacks._backup_store import UnusableBackupError

__all__ = ["KIND", "PlacedShard", "is_other_task", "read", "snapshot_function", "task_cpu"]

KIND = "tensors"
_write_functions = {}  # device -> tf.function that writes one shard there
_read_functions = {}


def _task(device):
    spec = tf.DeviceSpec.from_string(device)
    return spec.job or "localhost", spec.replica or 0, spec.task or 0


def is_other_task(device, here):
    """Whether `device` is on another task than the device `here` (of this process)."""
    return _task(device) != _task(here)


def task_cpu(device):
    """The CPU of the task that holds `device` (string and file ops have CPU kernels)."""
    job, replica, task = _task(device)
    return f"/job:{job}/replica:{replica}/task:{task}/device:CPU:0"


class PlacedShard:
    """The serialized variables of one task, held in that task's memory until written.

    Args:
        device: that task's CPU.
        indices: the variables' positions in the backup's variable list.
        content: the string tensor (on `device`) that `snapshot_function` made.
        dtypes: the variables' dtype names (to parse them back).
    """

    kind = KIND

    def __init__(self, device, indices, content, dtypes):
        self.device, self.indices, self.content, self.dtypes = device, list(indices), content, dtypes

    def write(self, path):
        function = _write_function(self.device)
        fingerprint, size = function(tf.constant(path), self.content)
        return {
            "size": int(size),
            "farmhash64": fingerprint.numpy().tobytes().hex(),
            "dtypes": self.dtypes,
            # Where TensorFlow placed the WriteFile op: the task that holds the variables.
            "written_on": _op_device(function, "WriteFile"),
        }


def snapshot_function(device, variables):
    """A tf.function that serializes `variables` (Keras variables) into one string on `device`."""
    tf_variables = [v.value for v in variables]

    @tf.function
    def serialize():
        with tf.device(device):
            parts = tf.stack([tf.io.serialize_tensor(v) for v in tf_variables])
            return tf.io.serialize_tensor(parts)

    serialize.get_concrete_function()  # traced now, not in the first backup's step
    return serialize


def _fingerprint(content):
    return tf.raw_ops.Fingerprint(data=tf.reshape(content, [1]), method="farmhash64")[0]


def _write_function(device):
    if device not in _write_functions:

        @tf.function(input_signature=[tf.TensorSpec([], tf.string), tf.TensorSpec([], tf.string)])
        def write(path, content):
            with tf.device(device):
                tf.io.write_file(path, content)
                return _fingerprint(content), tf.strings.length(content)

        _write_functions[device] = write
    return _write_functions[device]


def _read_function(device):
    if device not in _read_functions:

        @tf.function(input_signature=[tf.TensorSpec([], tf.string)])
        def read(path):
            with tf.device(device):
                content = tf.io.read_file(path)
                return content, _fingerprint(content), tf.strings.length(content)

        _read_functions[device] = read
    return _read_functions[device]


def _op_device(function, op_type):
    graph = function.get_concrete_function().graph
    return next(op.device for op in graph.get_operations() if op.type == op_type)


def read(path, record):
    """Verifies one placed shard on its task; its values, as tensors still on that task.

    Raises:
        UnusableBackupError: the file is missing, or its size or fingerprint differ
            from the manifest's, or it does not parse.
    """
    device = record["device"]
    try:
        content, fingerprint, size = _read_function(device)(tf.constant(path))
        if int(size) != record["size"]:
            raise UnusableBackupError(f"{path} has {int(size)} bytes, manifest says {record['size']}")
        if fingerprint.numpy().tobytes().hex() != record["farmhash64"]:
            raise UnusableBackupError(f"{path} does not match its farmhash64 in the manifest")
        with tf.device(device):
            parts = tf.io.parse_tensor(content, tf.string)
            return [tf.io.parse_tensor(parts[i], dtype) for i, dtype in enumerate(record["dtypes"])]
    except tf.errors.OpError as e:
        raise UnusableBackupError(f"{type(e).__name__} on {device}: {e.message[:200]}") from None
