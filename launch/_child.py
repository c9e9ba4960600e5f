"""Entry point of one task of `run_local_cluster`: call the target, pickle its result."""

import os
import pickle
import sys

from tfscale._task_protocol import RESULT_VAR
from tfscale.launch.local import load_target


def main(spec_path):
    fn, args, kwargs = load_target(spec_path)
    value = fn(*args, **kwargs)
    result_path = os.environ[RESULT_VAR]
    with open(result_path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(result_path + ".tmp", result_path)


if __name__ == "__main__":
    main(sys.argv[1])
