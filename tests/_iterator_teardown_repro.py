"""Reproducer: a `fit` under a strategy that stops at once can segfault in TF's iterator teardown.

    python tests/_iterator_teardown_repro.py --fits 2000 [--unpatched]

Trains a small model under `strategies.get("one_device")` with a callback that raises in
`on_train_begin`, `--fits` times in one process, the pattern of
tests/test_hostile_backup.py (53 such fits) and of a notebook that retries `fit`.
Unpatched (Keras as shipped), the iterator of each fit's symbolic build is dropped while
its MultiDeviceIterator still fills its buffer: measured here (TF 2.21.0, Keras 3.15.1, two
copies side by side, or one beside a pytest run, on 2 cores) 5 of 5 runs died of a segmentation fault
(exit 139) within 250 to 850 fits; one copy alone on a quiet machine ran 2,000 fits without
a crash. Patched (tfscale.compat.keras_symbolic_build, applied by strategies.get): 0 of
2 x 2,000 fits side by side. Not part of the suite: it takes minutes, and a crash is a
matter of chance and load.
"""

import argparse
import faulthandler
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fits", type=int, default=2000)
    parser.add_argument("--unpatched", action="store_true", help="Keras as shipped: expect a crash")
    args = parser.parse_args(argv)
    faulthandler.enable()
    import _backup_workers as workers
    import keras

    import tfscale.strategies
    from tfscale.compat import keras_symbolic_build

    strategy = tfscale.strategies.get("one_device")
    if args.unpatched:
        from keras.src.backend.tensorflow import trainer

        cls = trainer.TensorFlowTrainer
        cls._maybe_symbolic_build = cls._maybe_symbolic_build.__wrapped__
    assert args.unpatched or keras_symbolic_build.keep_first_input_iterator()

    class Stop(Exception):
        pass

    class StopAtBegin(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            raise Stop()

    model = workers.build_model(strategy)
    start = time.monotonic()
    for i in range(args.fits):
        try:
            model.fit(**workers.make_data("array", 8), epochs=3, callbacks=[StopAtBegin()], verbose=0)
        except Stop:
            pass
        if i % 250 == 0:
            print(f"{i} fits, {time.monotonic() - start:.0f} s", flush=True)
    print(f"{args.fits} fits, no crash, {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
