"""Functions run in each task of a local cluster by tests/test_datasets.py and test_train.py."""

import numpy as np

__all__ = ["shard_ids"]


def shard_ids(data_dir, global_batch_size, epochs, policies=("data", "files")):
    """Per sharding policy, the example ids this worker's replicas receive: [epoch][step] arrays."""
    import tensorflow as tf

    import tfscale.datasets
    import tfscale.strategies

    strategy = tfscale.strategies.get("multi_worker")
    tf.random.set_seed(0)  # tf.data shuffles depend on the global seed too; the test's reference uses 0
    out = {}
    for policy in policies:
        ds, info = tfscale.datasets.load(
            "digits",
            "train",
            global_batch_size,
            strategy,
            data_dir=data_dir,
            as_supervised=False,
            sharding=policy,
            with_info=True,
        )
        dist = strategy.experimental_distribute_dataset(ds)
        out[policy] = {
            "sharding": info.sharding,
            "worker_index": info.worker_index,
            "epochs": [
                [
                    np.concatenate([np.asarray(v) for v in strategy.experimental_local_results(batch["id"])])
                    for batch in dist
                ]
                for _ in range(epochs)
            ],
        }
    return out
