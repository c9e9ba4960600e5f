"""`synthetic:...` datasets: random tensors of a given shape, for benchmarks and smoke tests.

Grammar (all sizes positive integers):

    synthetic:images/HxWxC/CLASSES[/EXAMPLES]        float32 images in [0, 1), int labels
    synthetic:tokens/LENGTH/VOCAB/CLASSES[/EXAMPLES] int32 token ids in [0, VOCAB), int labels

EXAMPLES defaults to 1024. The data is a deterministic function of the name (seed 0),
generated in memory once, with an `id` feature like the bundled dataset.
"""

import dataclasses

import numpy as np

from tfscale.datasets._errors import DatasetError

__all__ = ["DEFAULT_EXAMPLES", "SyntheticSpec", "generate", "parse"]

DEFAULT_EXAMPLES = 1024
_GRAMMAR = "'synthetic:images/HxWxC/CLASSES[/EXAMPLES]' or 'synthetic:tokens/LENGTH/VOCAB/CLASSES[/EXAMPLES]'"


@dataclasses.dataclass(frozen=True)
class SyntheticSpec:
    """A parsed `synthetic:` name."""

    kind: str  # "images" or "tokens"
    shape: tuple
    num_classes: int
    num_examples: int
    vocab_size: int = 0


def _ints(name, parts):
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise DatasetError(f"Invalid synthetic dataset name. Received: name={name!r}. Expected {_GRAMMAR}.")
    return values


def parse(name):
    """Parses `synthetic:...` into a `SyntheticSpec`.

    Raises:
        DatasetError: the name does not follow the grammar above.
    """
    parts = name.split(":", 1)[1].split("/")
    kind, rest = parts[0], parts[1:]
    if kind == "images" and len(rest) in (2, 3):
        shape = tuple(_ints(name, rest[0].split("x")))
        if len(shape) != 3:
            raise DatasetError(
                f"Invalid synthetic image shape. Received: name={name!r}. Expected {_GRAMMAR}."
            )
        classes, *examples = _ints(name, rest[1:])
        return SyntheticSpec("images", shape, classes, (examples or [DEFAULT_EXAMPLES])[0])
    if kind == "tokens" and len(rest) in (3, 4):
        length, vocab, classes, *examples = _ints(name, rest)
        return SyntheticSpec("tokens", (length,), classes, (examples or [DEFAULT_EXAMPLES])[0], vocab)
    raise DatasetError(f"Invalid synthetic dataset name. Received: name={name!r}. Expected {_GRAMMAR}.")


def generate(spec):
    """Returns `{"image" or "tokens": array, "label": int64 array, "id": int64 array}`."""
    rng = np.random.default_rng(0)
    n = spec.num_examples
    if spec.kind == "images":
        x = {"image": rng.random((n, *spec.shape), dtype=np.float32)}
    else:
        x = {"tokens": rng.integers(0, spec.vocab_size, size=(n, *spec.shape), dtype=np.int32)}
    return {**x, "label": rng.integers(0, spec.num_classes, size=n), "id": np.arange(n, dtype=np.int64)}
