"""Functions run inside the tasks of a local cluster by tests/test_cluster.py.

`train` is also run in-process on one device, as the reference the cluster must match.
"""

import os

import numpy as np

GLOBAL_BATCH = 8
EPOCHS = 3


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(32, 4)).astype("float32")
    y = (x @ np.array([1.0, -2.0, 0.5, 3.0], "float32") + 0.25).reshape(-1, 1)
    return x, y


def train(strategy):
    """Fits a linear model under `strategy`; returns its losses and weights."""
    import keras
    import tensorflow as tf

    x, y = data()
    with strategy.scope():
        keras.utils.set_random_seed(7)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    history = model.fit(dataset, epochs=EPOCHS, verbose=0, shuffle=False)
    return {"loss": history.history["loss"], "weights": [np.asarray(w) for w in model.get_weights()]}


def fit_with_generated_tf_config(ports):
    """One task: TF_CONFIG from `ClusterSpec.from_hosts` on `ports`, then multi_worker `fit`.

    The launcher's own TF_CONFIG only tells this process which task it is; the
    cluster it trains in is the one tfscale generated, on the ports the test chose.
    """
    from tfscale.cluster import ClusterSpec

    me = ClusterSpec.from_env()
    spec = ClusterSpec.from_hosts(workers=[f"127.0.0.1:{port}" for port in ports])
    os.environ["TF_CONFIG"] = spec.to_json(me.task_type, me.task_index)

    import tfscale.strategies

    strategy = tfscale.strategies.get("multi_worker")
    resolver = strategy.cluster_resolver
    result = train(strategy)
    result.update(
        tf_config=os.environ["TF_CONFIG"],
        cluster=resolver.cluster_spec().as_dict(),
        task=(resolver.task_type, resolver.task_id),
        replicas=strategy.num_replicas_in_sync,
    )
    return result


def identity_from_the_spec_alone():
    """One task: its ClusterSpec taken from TF_CONFIG, which is then removed from the environment.

    `strategies.get("auto", cluster=spec)` must still build the multi-worker strategy, and
    the backups and datasets must read this task's place from that strategy, not from
    the environment.
    """
    from tfscale.cluster import ClusterSpec

    spec = ClusterSpec.from_env()
    del os.environ["TF_CONFIG"]

    import importlib

    import tensorflow as tf

    import tfscale.strategies

    load = importlib.import_module("tfscale.datasets.load")  # the module; the package exports load()

    strategy = tfscale.strategies.get("auto", cluster=spec)
    task = ClusterSpec.of_process(strategy)
    return {
        "multi_worker": isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy),
        "replicas": strategy.num_replicas_in_sync,
        "resolver_task": (strategy.cluster_resolver.task_type, strategy.cluster_resolver.task_id),
        "backup_role": (task.task_label, task.num_workers, task.is_writer),
        "dataset_worker": load._worker_context(strategy)[:2],
    }
