"""Runs the tutorial's `main.py` exactly as `python main.py` would, then saves the trained weights.

    python tests/_launch_tutorial.py examples/multi_worker_tutorial/main.py OUT_DIR

`main.py` ends with `multi_worker_model.fit(...)` and keeps the model in a global;
`runpy.run_path` returns those globals, so the file runs unchanged and the test
can still compare the weights of every worker. Prints whether tfscale's Keras
fixes are in effect (they can only come from `tfscale-launch --keras_compat`).
"""

import json
import os
import runpy
import sys

import numpy as np

__all__ = ["main"]


def main(main_py, out_dir):
    sys.path.insert(0, os.path.dirname(os.path.abspath(main_py)))
    sys.argv = [main_py]
    program = runpy.run_path(main_py, run_name="__main__")
    compat = sys.modules.get("tfscale.compat.keras_multi_worker")
    print(f"keras fixes applied: {bool(compat and compat.is_applied())}", flush=True)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    weights = [np.asarray(w) for w in program["multi_worker_model"].get_weights()]
    np.savez(os.path.join(out_dir, f"{task['type']}-{task['index']}.npz"), *weights)


if __name__ == "__main__":
    main(*sys.argv[1:])
