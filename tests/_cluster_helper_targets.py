"""Targets for tests/test_local_cluster.py: plain Python, no TensorFlow (fast)."""

import json
import os
import subprocess
import sys
import time


def report_task():
    config = json.loads(os.environ["TF_CONFIG"])
    return {"config": config, "environ": dict(os.environ)}


def hang_with_grandchild():
    # A grandchild in the same process group: it must die with the task.
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    time.sleep(600)


def fail_on_worker_one():
    if json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 1:
        raise RuntimeError("worker one gives up")
    time.sleep(600)  # A peer of a dead task: hangs like a blocked collective.
