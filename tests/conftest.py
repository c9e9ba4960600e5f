"""Shared test setup: one TensorFlow runtime per pytest process, split into 4 logical CPUs.

TensorFlow fixes its logical devices when its runtime starts, so the split happens here,
before any test touches TensorFlow. In-process tests use the first N of these 4 devices
(`cpu_replicas=N`, pipeline stages, model-split devices); multi-worker tests run in
subprocesses started by `tfscale.launch.run_local_cluster`.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tfscale.strategies

NUM_TEST_CPUS = 4
tfscale.strategies.split_cpu(NUM_TEST_CPUS)
