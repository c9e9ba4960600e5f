# The TensorFlow tutorial "Multi-worker training with Keras"
# (https://www.tensorflow.org/tutorials/distribute/multi_worker_with_keras), file
# `mnist_setup.py`, copied unchanged except for ONE thing: the tutorial downloads
# MNIST with `tf.keras.datasets.mnist.load_data()`; this copy must run offline, so
# `_offline_mnist_like()` makes 60000 synthetic 28x28 uint8 "digits" of 10 classes
# with the same shapes, dtypes and value range. Everything else is the tutorial's.
import numpy as np
import tensorflow as tf


def _offline_mnist_like(num_examples=60000, seed=0):
    """MNIST-shaped data: (x_train uint8 [60000, 28, 28], y_train uint8 [60000]), learnable."""
    rng = np.random.default_rng(seed)
    prototypes = rng.integers(0, 256, size=(10, 28, 28))
    y_train = rng.integers(0, 10, size=num_examples).astype(np.uint8)
    noise = rng.integers(-64, 65, size=(num_examples, 28, 28))
    x_train = np.clip(prototypes[y_train] + noise, 0, 255).astype(np.uint8)
    return (x_train, y_train), (None, None)


def mnist_dataset(batch_size):
    (x_train, y_train), _ = _offline_mnist_like()  # tutorial: tf.keras.datasets.mnist.load_data()
    # The `x` arrays are in uint8 and have values in the [0, 255] range.
    # You need to convert them to float32 with values in the [0, 1] range.
    x_train = x_train / np.float32(255)
    y_train = y_train.astype(np.int64)
    train_dataset = (
        tf.data.Dataset.from_tensor_slices((x_train, y_train)).shuffle(60000).repeat().batch(batch_size)
    )
    return train_dataset


def build_and_compile_cnn_model():
    model = tf.keras.Sequential(
        [
            tf.keras.layers.InputLayer(input_shape=(28, 28)),
            tf.keras.layers.Reshape(target_shape=(28, 28, 1)),
            tf.keras.layers.Conv2D(32, 3, activation="relu"),
            tf.keras.layers.Flatten(),
            tf.keras.layers.Dense(128, activation="relu"),
            tf.keras.layers.Dense(10),
        ]
    )
    model.compile(
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        optimizer=tf.keras.optimizers.SGD(learning_rate=0.001),
        metrics=["accuracy"],
    )
    return model
