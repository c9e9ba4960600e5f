"""A shard of variables that live on another task: gather it into the client, or write it there?

Starts a real two-task cluster on this machine (task 1: `tf.distribute.Server`; task 0,
this process: `experimental_connect_to_cluster`), creates one float32 variable of
`--mib` MiB on task 1, and backs it up both ways, `--repeat` times each:

- gather: the client reads the variable (`.numpy()`), writes it as `.npz`, fsyncs and
  hashes it (sha256): what the one-`state.npz` store did;
- placed: what `tfscale.callbacks._backup_placed` does: task 1 serializes the variable,
  fingerprints it and writes the file; only the fingerprint and size reach the client.

Prints the median time of each, the bytes that reached the client's Python side, and
the growth of the client's peak RSS (placed runs first, so its growth is not hidden by
the gather's). On loopback both tasks share the disk and the CPUs, so the time compares
the work, not a network: across hosts the gather also pays the transfer.

    python bench/bench_backup_placed.py [--mib 64] [--repeat 3]
"""

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from tfscale.launch._procs import free_ports

REMOTE = "/job:worker/replica:0/task:1/device:CPU:0"


def _ports():
    return [str(p) for p in free_ports(2)]


def _peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(function, repeat):
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        received = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), received


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    ports = _ports()
    server_code = (
        "import sys, tensorflow as tf\n"
        "spec = tf.train.ClusterSpec({'worker': ['localhost:' + p for p in sys.argv[1:3]]})\n"
        "s = tf.distribute.Server(spec, job_name='worker', task_index=1)\n"
        "print('ready', flush=True); s.join()\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", server_code, *ports],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        server.stdout.readline()
        _run(ports, args)
    finally:
        server.kill()
        server.wait()


def _run(ports, args):
    import hashlib

    import keras
    import numpy as np
    import tensorflow as tf

    from tfscale.callbacks import _backup_placed

    spec = tf.train.ClusterSpec({"worker": [f"localhost:{p}" for p in ports]})
    tf.config.experimental_connect_to_cluster(spec, job_name="worker", task_index=0)
    n = args.mib * (1 << 20) // 4
    with tf.device(REMOTE):
        variable = keras.Variable(tf.random.uniform([n], seed=1), name="big")
    serialize = _backup_placed.snapshot_function(REMOTE, [variable])
    directory = tempfile.mkdtemp(prefix="bench_backup_placed-")

    def placed():
        shard = _backup_placed.PlacedShard(REMOTE, [0], serialize(), ["float32"])
        shard.write(os.path.join(directory, "placed.tensors"))
        return 8 + 8  # the fingerprint and the size (int64) come back

    def gather():
        array = variable.numpy()
        path = os.path.join(directory, "gathered.npz")
        with open(path, "wb") as f:
            np.savez(f, array)
            f.flush()
            os.fsync(f.fileno())
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return array.nbytes

    placed()  # traces the functions and warms the connection
    base = _peak_rss_mib()
    placed_s, placed_bytes = _timed(placed, args.repeat)
    placed_rss = _peak_rss_mib() - base
    base = _peak_rss_mib()
    gather_s, gather_bytes = _timed(gather, args.repeat)
    gather_rss = _peak_rss_mib() - base
    print(f"variable on task 1: {args.mib} MiB float32; median of {args.repeat}")
    print(f"{'way':8} {'time s':>8} {'bytes to client':>16} {'client peak RSS +MiB':>21}")
    print(f"{'gather':8} {gather_s:8.3f} {gather_bytes:16d} {gather_rss:21.0f}")
    print(f"{'placed':8} {placed_s:8.3f} {placed_bytes:16d} {placed_rss:21.0f}")
    for name in os.listdir(directory):
        os.remove(os.path.join(directory, name))
    os.rmdir(directory)


if __name__ == "__main__":
    main()
