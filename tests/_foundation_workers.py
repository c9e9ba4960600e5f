"""Functions run inside the tasks of real local clusters (see tests/test_multi_worker.py).

Also used in-process to compute the single-device reference, so both sides train
exactly the same model on exactly the same data.
"""

import numpy as np

GLOBAL_BATCH = 16
EPOCHS = 2


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    y = (x[:, 0] + x[:, 1] > 0).astype("int32")
    x_predict = rng.normal(size=(60, 8)).astype("float32")  # 60: last batch is partial
    return x, y, x_predict


def build_model():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train_and_report(strategy):
    """Trains under `strategy`; returns history, evaluate, predict and weights."""
    import tensorflow as tf

    x, y, x_predict = data()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(GLOBAL_BATCH)
    with strategy.scope():
        model = build_model()
    history = model.fit(train, epochs=EPOCHS, verbose=0)
    evaluation = model.evaluate(train, verbose=0, return_dict=True)
    predictions = model.predict(tf.data.Dataset.from_tensor_slices(x_predict).batch(GLOBAL_BATCH), verbose=0)
    return {
        "history": history.history,
        "evaluate": evaluation,
        "predict": np.asarray(predictions),
        "weights": [np.asarray(w) for w in model.get_weights()],
        "replicas": strategy.num_replicas_in_sync,
    }


def tfscale_strategy(name, **options):
    """A task of the cluster: a strategy from `tfscale.strategies.get` (which applies the compat fix)."""
    import tensorflow as tf

    import tfscale.strategies

    strategy = tfscale.strategies.get(name, **options)
    is_mwms = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)
    return dict(train_and_report(strategy), multi_worker=is_mwms)


def stock_multi_worker(apply_fix):
    """A task of the cluster: the upstream recipe, with or without tfscale's one explicit call."""
    import tensorflow as tf

    if apply_fix:
        import tfscale.compat

        tfscale.compat.apply_multi_worker_fixes()
    return train_and_report(tf.distribute.MultiWorkerMirroredStrategy())
