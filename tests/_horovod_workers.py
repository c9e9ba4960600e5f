"""Horovod-style training scripts run by tests/test_horovod.py under `tfscale-launch -np N`.

`python _horovod_workers.py main OUT`: in one job, (a) a Keras `fit` with
DistributedOptimizer + BroadcastGlobalVariablesCallback + MetricAverageCallback +
LearningRateWarmupCallback, each rank on its shard, ranks starting from different
weights; (b) a custom loop with DistributedGradientTape in a tf.function and
broadcast_variables after the first step; (c) backward_passes_per_step=2; (d) bytes
of fp16 vs uncompressed all-reduces; (e) mismatched shapes/dtypes across ranks. Rank 0
also trains the single-process references (plain Keras, the concatenated batches).
Each rank writes OUT/rank<r>.npz.

`python _horovod_workers.py resume OUT BACKUP`: (a) with tfscale BackupAndRestore;
rank 1 SIGKILLs itself mid-epoch in the first attempt (TFSCALE_RESTART_COUNT=0).
"""

import json
import os
import signal
import sys

import numpy as np

BATCH = 8  # per rank
STEPS = 6  # per epoch
EPOCHS = 2
LR = 0.05


def data(size, steps=STEPS, batch=BATCH):
    rng = np.random.default_rng(0)
    n = steps * batch * size
    x = rng.normal(size=(n, 5)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    return x, y


def shard(array, rank, size, batch=BATCH):
    """Rank r's rows: its `batch` rows of each global batch of `batch * size` rows."""
    blocks = array.reshape(-1, size, batch, *array.shape[1:])
    return blocks[:, rank].reshape(-1, *array.shape[1:])


def model(seed):
    import keras

    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)]
    )


def weights(m):
    return [np.asarray(w) for w in m.get_weights()]


class _RawLogs:
    """Keeps each epoch's logs as this rank computed them (before MetricAverageCallback)."""

    def __new__(cls):
        import keras

        class Raw(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.epochs = []

            def on_epoch_end(self, epoch, logs=None):
                self.epochs.append({k: float(v) for k, v in logs.items()})

        return Raw()


def fit_horovod(hvd, x, y, seed, callbacks=(), passes=1, epochs=EPOCHS):
    import keras

    m = model(seed)
    opt = hvd.DistributedOptimizer(
        keras.optimizers.SGD(LR, momentum=0.9),
        backward_passes_per_step=passes,
        average_aggregated_gradients=True,
    )
    m.compile(opt, "mse")
    raw = _RawLogs()
    cbs = [
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        raw,
        hvd.callbacks.MetricAverageCallback(),
        hvd.callbacks.LearningRateWarmupCallback(LR * hvd.size(), warmup_epochs=1),
        *callbacks,
    ]
    history = m.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=cbs)
    return m, raw.epochs, history.history


def fit_reference(hvd, x, y, seed, batch, epochs=EPOCHS):
    """One process, plain Keras optimizer, the concatenated batches; the same LR callbacks."""
    import keras

    m = model(seed)
    m.compile(keras.optimizers.SGD(LR, momentum=0.9), "mse")
    warmup = hvd.callbacks.LearningRateWarmupCallback(LR * hvd.size(), warmup_epochs=1)
    history = m.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[warmup])
    return m, history.history


def custom_loop(hvd, x, y, seed, eager=False):
    import keras
    import tensorflow as tf

    m = model(seed)
    opt = keras.optimizers.Adam(0.01)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(xb) - yb))
        tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss, m.trainable_variables)
        opt.apply_gradients(zip(grads, m.trainable_variables))
        return loss

    if not eager:
        step = tf.function(step)
    for i, (xb, yb) in enumerate(ds):
        step(xb, yb)
        if i == 0:
            hvd.broadcast_variables(m.variables, root_rank=0)
            hvd.broadcast_variables(opt.variables, root_rank=0)
    return m


def custom_reference(x, y, seed, batch):
    import keras
    import tensorflow as tf

    m = model(seed)
    opt = keras.optimizers.Adam(0.01)
    for xb, yb in tf.data.Dataset.from_tensor_slices((x, y)).batch(batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(m(xb) - yb))
        opt.apply_gradients(zip(tape.gradient(loss, m.trainable_variables), m.trainable_variables))
    return m


def loopback_bytes():
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])  # transmitted bytes
    return 0


def compression_bytes(hvd, n=1 << 20, repeats=5):
    """Bytes handed to the collective per all-reduce, and loopback bytes sent, none vs fp16."""
    import tensorflow as tf

    from tfscale.horovod import _basics

    value = tf.random.stateless_normal([n], seed=[hvd.rank(), 0])
    out = {}
    for label, compression in (("none", hvd.Compression.none), ("fp16", hvd.Compression.fp16)):
        hvd.allreduce(tf.zeros([1]), name="barrier")
        launched, lo = _basics._State.collectives.bytes_launched, loopback_bytes()
        for _ in range(repeats):
            result = hvd.allreduce(value, compression=compression, name=label)
        out[label] = {
            "launch_bytes": (_basics._State.collectives.bytes_launched - launched) / repeats,
            "loopback_bytes": (loopback_bytes() - lo) / repeats,
            "dtype": result.dtype.name,
        }
    return out


def mismatches(hvd):
    import tensorflow as tf

    found = {}
    cases = {
        "allreduce_shape": lambda: hvd.allreduce(tf.ones([2 + hvd.rank(), 3]), name="grad"),
        "broadcast_dtype": lambda: hvd.broadcast(tf.ones([4], tf.float32 if hvd.rank() else tf.float64), 0),
        "allgather_inner": lambda: hvd.allgather(tf.ones([2, 1 + hvd.rank()])),
    }
    for name, call in cases.items():
        try:
            call()
            found[name] = None
        except hvd.HorovodError as e:
            found[name] = str(e)
    # The collectives still work after the checks refused those calls.
    found["after"] = float(hvd.allreduce(tf.constant(1.0 + hvd.rank()), op=hvd.Sum))
    found["allgather_ragged"] = (
        hvd.allgather(tf.fill([1 + hvd.rank(), 2], float(hvd.rank()))).numpy().tolist()
    )
    return found


def run_target(value):
    """For `hvd.run`: each rank's rank, size and the sum of `value * (rank + 1)` over ranks."""
    import tensorflow as tf

    import tfscale.horovod as hvd

    hvd.init()
    total = hvd.allreduce(tf.constant(value * (hvd.rank() + 1)), op=hvd.Sum)
    return hvd.rank(), hvd.size(), float(total)


def main(out):
    import tfscale.horovod as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x, y = data(size)
    results = {}
    m, raw, history = fit_horovod(hvd, shard(x, rank, size), shard(y, rank, size), seed=100 + rank)
    results["fit"] = weights(m)
    info = {
        "raw": raw,
        "history": history,
        "identity": [rank, size, hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
    }
    results["loop"] = weights(custom_loop(hvd, shard(x, rank, size), shard(y, rank, size), seed=7))
    eager = custom_loop(hvd, shard(x, rank, size), shard(y, rank, size), seed=7, eager=True)
    results["loop_eager"] = weights(eager)
    x2, y2 = data(size, steps=2 * STEPS)
    m2, _, _ = fit_horovod(hvd, shard(x2, rank, size), shard(y2, rank, size), seed=100 + rank, passes=2)
    results["passes"] = weights(m2)
    info["iterations_passes"] = int(m2.optimizer.iterations.numpy())
    info["compression"] = compression_bytes(hvd)
    info["mismatch"] = mismatches(hvd)
    if rank == 0:
        ref, ref_history = fit_reference(hvd, x, y, seed=100, batch=BATCH * size)
        results["fit_ref"] = weights(ref)
        info["ref_history"] = ref_history
        results["loop_ref"] = results["loop_eager_ref"] = weights(
            custom_reference(x, y, seed=7, batch=BATCH * size)
        )
        ref2, _ = fit_reference(hvd, x2, y2, seed=100, batch=2 * BATCH * size, epochs=EPOCHS)
        results["passes_ref"] = weights(ref2)
        info["iterations_ref"] = int(ref2.optimizer.iterations.numpy())
    save(out, rank, results, info)


def save(out, rank, results, info):
    arrays = {f"{k}/{i}": w for k, ws in results.items() for i, w in enumerate(ws)}
    np.savez(os.path.join(out, f"rank{rank}.npz"), **arrays)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(info, f, default=float)


def resume(out, backup_dir):
    import keras

    import tfscale
    import tfscale.horovod as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    attempt = int(os.environ.get("TFSCALE_RESTART_COUNT", "0"))
    x, y = data(size)

    class KillMidRun(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if attempt == 0 and rank == 1 and self.epoch == 1 and batch == 2:
                print(f"rank {rank}: SIGKILL at epoch 1 batch {batch}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

    backup = tfscale.callbacks.BackupAndRestore(backup_dir, save_freq=1)
    print(f"rank {rank} attempt {attempt} pid {os.getpid()}", flush=True)
    m, _, _ = fit_horovod(
        hvd, shard(x, rank, size), shard(y, rank, size), seed=100 + rank, callbacks=[backup, KillMidRun()]
    )
    results = {"fit": weights(m)}
    restored = backup.restored_from
    info = {"attempt": attempt, "restored_step": None if restored is None else restored["global_step"]}
    if rank == 0:
        results["fit_ref"] = weights(fit_reference(hvd, x, y, seed=100, batch=BATCH * size)[0])
    save(out, rank, results, info)


if __name__ == "__main__":
    {"main": main, "resume": resume}[sys.argv[1]](*sys.argv[2:])
