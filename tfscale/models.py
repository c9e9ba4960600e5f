"""The model registry of `tfscale-train`: small classifiers, and `module.path:factory` for yours.

Keras is imported when a model is built, not with this module, so `tfscale.flags` checks
`--model` against `MODELS` itself before TensorFlow starts.

Every factory is called as `factory(input_shape, num_classes)` inside `strategy.scope()`
and returns an uncompiled `keras.Model` whose output is logits (float32, also under a
mixed-precision policy, so the loss is computed in float32).
"""

import importlib

from tfscale.errors import Error, first_line

__all__ = ["MODELS", "ModelError", "build", "cnn", "mlp", "transformer"]


class ModelError(Error):
    """A `--model` name or factory that cannot build a model (names the value and the choices)."""


def _logits(x, num_classes):
    import keras

    return keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)


def mlp(input_shape, num_classes, hidden=(128, 64)):
    """A multilayer perceptron over the flattened input."""
    import keras

    inputs = keras.Input(input_shape)
    x = keras.layers.Flatten()(inputs)
    for width in hidden:
        x = keras.layers.Dense(width, activation="relu")(x)
    return keras.Model(inputs, _logits(x, num_classes), name="mlp")


def cnn(input_shape, num_classes, filters=(32, 64)):
    """A small convolutional network for (H, W, C) images."""
    if len(input_shape) != 3:
        raise ModelError(
            f"Model 'cnn' needs (height, width, channels) inputs. Received: "
            f"input_shape={tuple(input_shape)}. Expected an image dataset, or --model=mlp / transformer."
        )
    import keras

    inputs = keras.Input(input_shape)
    x = inputs
    for f in filters:
        x = keras.layers.Conv2D(f, 3, padding="same", activation="relu")(x)
        if x.shape[1] >= 4 and x.shape[2] >= 4:
            x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, _logits(x, num_classes), name="cnn")


def _encoder_block(x, width, heads):
    import keras

    attended = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    hidden = keras.layers.Dense(2 * width, activation="relu")(x)
    return keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(hidden))


def transformer(input_shape, num_classes, *, width=64, heads=4, blocks=2, vocab_size=None):
    """A small Transformer encoder classifier.

    Images (H, W, C) are read as H tokens of W*C features (rows as a sequence); integer
    token sequences (LENGTH,) are embedded (`vocab_size` required for those).
    """
    import keras

    inputs = keras.Input(input_shape, dtype="int32" if vocab_size else "float32")
    if vocab_size:
        x = keras.layers.Embedding(vocab_size, width)(inputs)
    else:
        rows = input_shape[0]
        x = keras.layers.Reshape((rows, -1))(inputs)
        x = keras.layers.Dense(width)(x)
    length = x.shape[1]
    positions = keras.ops.arange(length)
    x = x + keras.layers.Embedding(length, width)(positions)
    for _ in range(blocks):
        x = _encoder_block(x, width, heads)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, _logits(x, num_classes), name="transformer")


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def _factory(name):
    if name in MODELS:
        return MODELS[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ModelError(
            f"Unknown model. Received: model={name!r}. Expected one of {sorted(MODELS)} or "
            "'module.path:factory'."
        )
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as e:  # the user's module may raise anything while it imports
        raise ModelError(
            f"Cannot load model factory. Received: model={name!r} ({type(e).__name__}: {first_line(e)})."
        ) from e
    if not callable(factory):
        raise ModelError(f"Model factory is not callable. Received: model={name!r}.")
    return factory


def build(name, input_shape, num_classes, **options):
    """Builds model `name` for inputs of `input_shape` and `num_classes` classes.

    Args:
        name: "mlp", "cnn", "transformer", or "module.path:factory" (called as
            `factory(input_shape, num_classes, **options)`).
        input_shape: shape of one example, without the batch dimension.
        num_classes: number of classes (the width of the logits).
        **options: passed on to the factory (e.g. `vocab_size` for token inputs).

    Returns:
        A `keras.Model` producing float32 logits.

    Raises:
        ModelError: unknown name, a factory that cannot be imported, that raises, or
            that returns no `keras.Model`.
    """
    import keras

    factory = _factory(name)
    try:
        model = factory(tuple(input_shape), num_classes, **options)
    except Error:
        raise
    except Exception as e:  # the binary shows one line; `from e` keeps the rest
        raise ModelError(
            f"Model factory raised {type(e).__name__}: {first_line(e)}. Received: model={name!r}. "
            f"Expected a function (input_shape, num_classes) returning a keras.Model."
        ) from e
    if not isinstance(model, keras.Model):
        raise ModelError(
            f"Model factory returned {type(model).__name__}. Received: model={name!r}. "
            "Expected a keras.Model."
        )
    return model
