"""Runs the tutorial's `main.py` exactly as `python main.py` would, then saves the trained weights.

    python tests/_launch_tutorial.py examples/multi_worker_tutorial/main.py OUT_DIR

`main.py` ends with `multi_worker_model.fit(...)` and keeps the model and its
`strategy` in globals; `runpy.run_path` returns those globals, so the file runs
unchanged and the test can still compare the weights of every worker. Then, on
the tutorial's own `MultiWorkerMirroredStrategy`, it fits `_global_batch_probe`
(a masked loss, an uneven last batch, clipnorm) and saves that model's weights
and losses as `<task>-probe.npz`: plain Keras's one-device numbers only with
tfscale's loss-denominator and optimizer fixes. Prints whether tfscale's Keras
fixes are in effect (they can only come from `tfscale-launch --keras_compat`).
"""

import json
import os
import runpy
import sys

import numpy as np

__all__ = ["main"]


def _applied(module_name):
    module = sys.modules.get(module_name)
    return bool(module and module.is_applied())


def main(main_py, out_dir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(main_py)))
    sys.argv = [main_py]
    program = runpy.run_path(main_py, run_name="__main__")
    print(f"keras fixes applied: {_applied('tfscale.compat.keras_multi_worker')}", flush=True)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    weights = [np.asarray(w) for w in program["multi_worker_model"].get_weights()]
    np.savez(os.path.join(out_dir, f"{task['type']}-{task['index']}.npz"), *weights)
    import _global_batch_probe  # beside this file; imports no tfscale

    probe_weights, losses = _global_batch_probe.train(program["strategy"])
    applied = [_applied(f"tfscale.compat.{name}") for name in ("keras_optimizer", "keras_loss_denominator")]
    print(f"global-batch fixes applied: {applied}", flush=True)
    probe = os.path.join(out_dir, f"{task['type']}-{task['index']}-probe.npz")
    np.savez(probe, *probe_weights, loss=np.asarray(losses))


if __name__ == "__main__":
    main(*sys.argv[1:])
