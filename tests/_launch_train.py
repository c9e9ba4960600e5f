"""A small Keras 3 multi-worker training program, run by `tfscale-launch` in the tests and the bench.

    python tests/_launch_train.py --out DIR [--epochs 3] [--backup_dir D] [--fail_step S]
        [--fail_task worker:1] [--step_sleep 0.0]

Reads its task from TF_CONFIG (as any program under the launcher does), trains a
small MLP under `tfscale.strategies.get("multi_worker")` on fixed data, prints
`step N` after every step (flushed: the launcher's heartbeat rule watches output)
and `first-step-at T` (wall clock) after the first, and writes its final weights
to `DIR/<type>-<index>.npz`. With `--backup_dir` it resumes from
`tfscale.callbacks.BackupAndRestore`; with `--fail_step` the task `--fail_task`
SIGKILLs itself after that global step (`tfscale.callbacks.FailAt`).
"""

import argparse
import json
import os
import time

import numpy as np

__all__ = ["main"]

NUM_SAMPLES, FEATURES, GLOBAL_BATCH = 192, 8, 16  # 12 steps an epoch


def _args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--backup_dir")
    parser.add_argument("--save_freq", type=int, default=4)
    parser.add_argument("--fail_step", type=int)
    parser.add_argument("--fail_task", default="worker:1")
    parser.add_argument("--step_sleep", type=float, default=0.0)
    return parser.parse_args()


def _callbacks(args, task):
    import keras

    import tfscale.callbacks

    class _Steps(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(self.model.optimizer.iterations.numpy())
            if not hasattr(self, "_first"):
                self._first = time.time()
                print(f"first-step-at {self._first:.6f}", flush=True)
            print(f"step {step}", flush=True)
            time.sleep(args.step_sleep)

    callbacks = []
    if args.backup_dir:
        callbacks.append(tfscale.callbacks.BackupAndRestore(args.backup_dir, save_freq=args.save_freq))
    if args.fail_step:
        task_type, index = args.fail_task.split(":")
        callbacks.append(tfscale.callbacks.FailAt(args.fail_step, "sigkill", task=(task_type, int(index))))
    return [*callbacks, _Steps()]


def main():
    args = _args()
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    print(f"started {task['type']}:{task['index']}", flush=True)  # output before TF's slow import
    import keras

    import tfscale.strategies

    strategy = tfscale.strategies.get("multi_worker")
    print("cluster connected", flush=True)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_SAMPLES, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1))).astype("float32")
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential(
            [keras.Input((FEATURES,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)]
        )
        model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=_callbacks(args, task),
    )
    path = os.path.join(args.out, f"{task['type']}-{task['index']}.npz")
    np.savez(path + ".tmp.npz", *[np.asarray(w) for w in model.get_weights()])
    os.replace(path + ".tmp.npz", path)
    print(f"done after step {int(model.optimizer.iterations.numpy())}", flush=True)


if __name__ == "__main__":
    main()
