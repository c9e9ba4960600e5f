"""A cheap task for the elastic launcher tests (no TensorFlow): acts by cluster size and attempt.

    python tests/_elastic_task.py GO_FILE

Prints `size N index I restart R`; on SIGTERM prints `backed up` and exits 75
(what `BackupAndRestore` does). On 3 workers in the first attempt, worker 2 exits
1 once GO_FILE exists (a lost worker); on 2 workers every task runs until asked
to stop (the launcher grows the job); on 3 workers after a restart it exits 0.
"""

import json
import os
import signal
import sys
import time


def _stop(signum, frame):
    del signum, frame
    print("backed up", flush=True)
    sys.exit(75)


def main(go_file):
    signal.signal(signal.SIGTERM, _stop)
    config = json.loads(os.environ["TF_CONFIG"])
    size, index = len(config["cluster"]["worker"]), config["task"]["index"]
    restart = int(os.environ["TFSCALE_RESTART_COUNT"])
    print(f"size {size} index {index} restart {restart}", flush=True)
    if size == 3 and restart > 0:
        return
    while not (size == 3 and index == 2 and os.path.exists(go_file)):
        time.sleep(0.05)
    sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
