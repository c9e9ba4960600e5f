"""Functions run in the tasks of a local cluster by tests/test_hybrid_cluster.py.

Task 0 (worker 0) is the client that trains; the other task serves its devices and returns
None once the client has gone. `train` is also run in the test process on one device, as
the reference.
"""

import os
import re
import signal
import subprocess
import time

import numpy as np

EPOCHS, BATCH, SAMPLES = 2, 16, 32
HIDDEN = (12, 10, 8)
CLUSTER_TIMEOUT = 60.0
MEASURED_EPOCHS = 5
# Sizes for the bytes measurement (`python tests/_hybrid_cluster_workers.py`): hidden
# widths, global batch. "test" is the tests' model; the others scale the activations
# (batch) or the parameters (width) that each shape sends across.
SIZES = {"test": (HIDDEN, BATCH), "wide": ((512, 512, 512), 32), "big-batch": ((64, 64, 64), 4096)}


def model(hidden=HIDDEN):
    import keras

    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(hidden[0], activation="relu"),
            keras.layers.Dense(hidden[1], activation="tanh"),
            keras.layers.Dense(hidden[2], activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
            keras.layers.Dense(3),
        ],
        name="mlp",
    )


def data(samples=SAMPLES):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(samples, 6)).astype("float32")
    return x, rng.normal(size=(samples, 3)).astype("float32")


def compile_(m):
    import keras

    m.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9), loss="mse", metrics=["mae"])
    return m


def train(m, epochs=EPOCHS, callbacks=(), batch=BATCH):
    x, y = data(2 * batch)
    history = m.fit(
        x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=list(callbacks)
    )
    return history.history


def _connect(cpu_devices):
    import tfscale.strategies
    from tfscale.cluster import ClusterSpec

    tfscale.strategies.split_cpu(cpu_devices)
    return tfscale.strategies.connect_cluster(ClusterSpec.from_env(), cluster_timeout=CLUSTER_TIMEOUT)


def _cluster_ports():
    from tfscale.cluster import ClusterSpec

    return {int(a.rpartition(":")[2]) for _, _, a in ClusterSpec.from_env().tasks()}


def _bytes_between_tasks(ports):
    """Bytes sent so far on every TCP connection to a task's port (both ends are on this
    host, so each byte sent counts once), read from the kernel with `ss`."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established"], check=True, capture_output=True, text=True
    ).stdout
    total, lines = 0, out.splitlines()
    for head, info in zip(lines[::2], lines[1::2]):
        addresses = head.split()[-2:]
        if any(int(a.rpartition(":")[2]) in ports for a in addresses):
            match = re.search(r"bytes_sent:(\d+)", info)
            total += int(match.group(1)) if match else 0
    return total


def _placement(pipelined):
    """Per replica and stage: the devices of its variables and of their optimizer slots."""
    from tfscale.strategies._placement import variable_device

    optimizers = pipelined._plan.data_parallel.optimizers or [pipelined.optimizer]
    rows = []
    for stages, optimizer in zip(pipelined.replicas, optimizers):
        slots = {v.path.split("/", 1)[1]: v for v in optimizer.variables}
        rows.append(
            [
                {
                    "variables": sorted({variable_device(v) for v in stage.trainable_variables}),
                    "slots": sorted(
                        {
                            variable_device(slots[v.path.replace("/", "_") + "_momentum"])
                            for v in stage.trainable_variables
                        }
                    ),
                }
                for stage in stages
            ]
        )
    return rows


def _payload(shape, hidden, batch, pipelined):
    """The tensors that must cross between the tasks each step (float32 bytes).

    Stages on two tasks: the cut's activation forward and its gradient back, for every
    micro-batch (2 x (S - 1) x batch x width), and the targets to the last stage.
    2 x 2: each task's packed gradients of each stage to the other (2 x (D - 1) x
    parameters), and copy 1's half of the batch (inputs and targets).
    """
    if shape == "stages":
        return 4 * (2 * batch * hidden[1] + batch * 3)
    params = sum(int(np.prod(v.shape)) for v in pipelined.trainable_variables)
    return 4 * (2 * params + batch // 2 * (6 + 3))


def _errors(make):
    import tfscale

    try:
        make()
    except tfscale.Error as error:
        return str(error)
    return None


def pipeline(shape, size="test", workdir=None):
    """Trains the MLP as `shape` ("stages": one stage per task; "hybrid": 2 devices a task,
    data parallel across the tasks); returns losses, weights, placement, bytes and step time.

    `size`: a key of `SIZES` (the tests use "test"). `workdir`: also back up and resume
    there (`_backup_and_resume`), under "backup".
    """
    hidden, batch = SIZES[size]
    if not _connect(2 if shape == "hybrid" else 1):
        return None
    import tfscale.strategies

    remote = "/job:worker/replica:0/task:{}/device:CPU:{}"
    if shape == "stages":
        options = {"num_stages": 2, "devices": [remote.format(0, 0), remote.format(1, 0)]}
    else:  # What the user writes on one host: the default devices are now the cluster's.
        options = {"num_stages": 2, "data_parallel": 2}
    strategy = tfscale.strategies.get("pipeline", num_microbatches=2, balance="uniform", **options)
    pipelined = compile_(strategy.split(model(hidden)))
    history = train(pipelined, batch=batch)
    result = {
        "history": history,
        "weights": [np.asarray(w) for w in pipelined.get_weights()],
        "placement": _placement(pipelined),
        "devices": strategy.devices,
    }
    # More epochs, measured: bytes on the wire between the tasks, and time per step.
    ports, steps = _cluster_ports(), MEASURED_EPOCHS * 2
    before, start = _bytes_between_tasks(ports), time.perf_counter()
    train(pipelined, epochs=MEASURED_EPOCHS, batch=batch)
    result["step_seconds"] = (time.perf_counter() - start) / steps
    result["bytes_per_step"] = (_bytes_between_tasks(ports) - before) / steps
    result["bytes_formula"] = _payload(shape, hidden, batch, pipelined)
    result["bad_task"] = _errors(
        lambda: tfscale.strategies.get(
            "pipeline", num_stages=2, devices=[remote.format(0, 0), remote.format(7, 0)]
        )
    )
    result["too_many"] = _errors(
        lambda: tfscale.strategies.get("pipeline", num_stages=2, data_parallel=len(strategy.devices))
    )
    if workdir is not None:
        result["backup"] = _backup_and_resume(strategy, hidden, batch, workdir)
    return result


def _backup_and_resume(strategy, hidden, batch, workdir):
    """A fresh pipelined model trained with `BackupAndRestore(save_freq=1)` fails after
    step 3 (of 4); another resumes from the backup. Returns the step-3 backup's shard
    records with the names of their variables, the names of the variables that live on
    another task than the client's, the step resumed from and the resumed weights."""
    import json

    import tfscale.callbacks
    from tfscale.strategies._placement import variable_device

    backup_dir = os.path.join(workdir, "backup")
    interrupted = compile_(strategy.split(model(hidden)))
    try:
        train(
            interrupted,
            batch=batch,
            callbacks=[
                tfscale.callbacks.BackupAndRestore(backup_dir, save_freq=1),
                tfscale.callbacks.FailAt(3, mode="raise"),
            ],
        )
    except tfscale.callbacks.InjectedFault:
        pass
    with open(os.path.join(backup_dir, "ckpt-000000000003", "manifest.json")) as f:
        manifest = json.load(f)
    # The backup's variable list: the model's variables, the optimizer's, then the metrics'.
    meta = manifest["meta"]
    names = [path for path, _, _ in meta["model"] + meta["optimizer_variables"] + meta["metric_variables"]]
    state = list(interrupted.variables) + list(interrupted.optimizer.variables)
    state += list(interrupted.metrics_variables)
    callback = tfscale.callbacks.BackupAndRestore(backup_dir, save_freq=1)
    resumed = compile_(strategy.split(model(hidden)))
    train(resumed, batch=batch, callbacks=[callback])
    return {
        "shards": [
            {
                **{k: s.get(k) for k in ("kind", "device", "written_on")},
                "names": [names[i] for i in s["variables"]],
            }
            for s in manifest["shards"]
        ],
        "on_task_1": sorted(v.path for v in state if "/task:1/" in variable_device(v)),
        "stage_2": sorted(v.path for v in interrupted.stages[1].trainable_variables),
        "restored_step": callback.restored_from["global_step"],
        "weights": [np.asarray(w) for w in resumed.get_weights()],
    }


class _KillTask:
    """Kills the task whose pid is in `pid_path` with SIGKILL after global batch `at`."""

    def __new__(cls, at, pid_path):
        import keras

        class Kill(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seen = 0

            def on_train_batch_end(self, batch, logs=None):
                self.seen += 1
                if self.seen == at:
                    with open(pid_path) as f:
                        os.kill(int(f.read()), signal.SIGKILL)

        return Kill()


def resumable(workdir, kill_at=None):
    """The 2 x 2 hybrid job with `BackupAndRestore(save_freq=1)` in `workdir`/backup.

    Task 1 writes its pid first; with `kill_at`, the client kills it (SIGKILL) after that
    many batches of this run, mid-epoch, and the next step fails. Returns the client's
    final weights and the path of its weights file.
    """
    from tfscale.cluster import ClusterSpec

    pid_path = os.path.join(workdir, "task1.pid")
    if ClusterSpec.from_env().task_index == 1:
        with open(pid_path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(pid_path + ".tmp", pid_path)
    if not _connect(2):
        return None
    import tfscale.callbacks
    import tfscale.strategies

    strategy = tfscale.strategies.get(
        "pipeline", num_stages=2, num_microbatches=2, data_parallel=2, balance="uniform"
    )
    pipelined = compile_(strategy.split(model()))
    callbacks = [tfscale.callbacks.BackupAndRestore(os.path.join(workdir, "backup"), save_freq=1)]
    if kill_at is not None:
        callbacks.append(_KillTask(kill_at, pid_path))
    history = train(pipelined, callbacks=callbacks)
    path = os.path.join(workdir, "hybrid.weights.h5")
    pipelined.save_weights(path)
    return {"history": history, "weights": [np.asarray(w) for w in pipelined.get_weights()], "path": path}


if __name__ == "__main__":
    # Bytes between the two tasks per step, measured beside the payload formula, and the
    # step time, for both shapes at each size (about 2 minutes on 2 busy cores).
    import sys

    from tfscale.launch import run_local_cluster

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _hybrid_cluster_workers as workers  # By name: a task cannot import `__main__`.

    print("| size | shape | bytes/step measured | payload formula | s/step |")
    print("|---|---|---|---|---|")
    for size in sys.argv[1:] or SIZES:
        for shape in ("stages", "hybrid"):
            env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
            r = run_local_cluster(workers.pipeline, 2, args=(shape, size), timeout=300, env=env)[0].value
            print(
                f"| {size} {SIZES[size]} | {shape} | {r['bytes_per_step']:.0f} | {r['bytes_formula']} "
                f"| {r['step_seconds']:.4f} |",
                flush=True,
            )
