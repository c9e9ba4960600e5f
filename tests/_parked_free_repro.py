"""How long a fit after a raising fit waits for the raising fit's iterators to be freed.

Not a test (a measurement; tfscale/compat/keras_symbolic_build.py quotes it): N times, a fit
under a 2-replica MirroredStrategy raises at its 4th step, then a short fit runs; prints each
call of `_release_parked` over 1 s (wall and process CPU) and the totals. `--inline` frees
the parked iterators in the fit's own thread, as before the freeing thread. Run it beside
busy loops to see the waits (`python3 -c "while True: pass" &` twice on 2 cores):

    python tests/_parked_free_repro.py [N] [--inline]
"""

import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np

from tfscale import strategies
from tfscale.compat import keras_symbolic_build as ksb


class _Raise(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3:
            raise RuntimeError("interrupted")


def _inline():
    now = time.monotonic()
    with ksb._lock:
        idle = [e for e in ksb._PARKED if now - e[0] >= ksb._IDLE_AFTER]
        ksb._PARKED[:] = [e for e in ksb._PARKED if now - e[0] < ksb._IDLE_AFTER]
    del idle


def main(argv):
    runs = int(next((a for a in argv[1:] if a.isdigit()), 25))
    strategies.split_cpu(2)
    release = _inline if "--inline" in argv else ksb._release_parked
    spent = []

    def timed():
        wall, cpu = time.monotonic(), time.process_time()
        release()
        wall, cpu = time.monotonic() - wall, time.process_time() - cpu
        spent.append(wall)
        if wall > 1:
            print(f"release {wall:.1f} s, CPU {cpu:.1f} s", flush=True)

    ksb._release_parked = timed
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = x[:, :1]
    start = time.monotonic()
    for _ in range(runs):
        strategy = strategies.get("mirrored", cpu_replicas=2)
        with strategy.scope():
            layers = [keras.Input((8,)), keras.layers.Dense(16, "relu"), keras.layers.Dense(1)]
            model = keras.Sequential(layers)
            model.compile("adam", "mse")
        try:
            model.fit(x, y, batch_size=8, verbose=0, callbacks=[_Raise()])
        except RuntimeError:
            pass
        model.fit(x[:16], y[:16], batch_size=8, verbose=0)
    ksb.wait_until_freed()
    print(
        f"{runs} runs: {sum(spent):.2f} s in {len(spent)} calls (max {max(spent):.2f} s), "
        f"whole run {time.monotonic() - start:.0f} s"
    )


if __name__ == "__main__":
    main(sys.argv)
