"""Where examples come from: TFDS folders, the bundled digits, synthetic tensors.

Each source gives an unbatched `tf.data.Dataset` of feature dicts (with `id` where the
dataset has one) and the facts `load` needs to shard, cache and batch it.
"""

import dataclasses
import os

import tensorflow as tf
import tensorflow_datasets as tfds

from tfscale.datasets import digits, synthetic
from tfscale.datasets._errors import DatasetError, UnknownSplitError

__all__ = ["BUNDLED", "Source", "default_data_dir", "resolve"]

BUNDLED = "digits"
_NAMES_HELP = f"'{BUNDLED}', 'tfds:NAME[/CONFIG][:VERSION]' or 'synthetic:...'"


def default_data_dir():
    """Where the bundled dataset is prepared when no `data_dir` is given."""
    return os.environ.get("TFSCALE_DATA_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "tfscale", "tensorflow_datasets"
    )


@dataclasses.dataclass(frozen=True)
class Source:
    """One dataset split, ready to be read."""

    name: str
    split: str
    num_examples: int
    num_files: int
    size_bytes: int
    num_classes: int
    feature_key: str
    in_memory: bool  # already held in memory: caching would only copy it
    read: object  # read(shuffle_files, seed, input_context) -> unbatched tf.data.Dataset of dicts


def resolve(name, split, data_dir=None):
    """Returns the `Source` for `name` and `split`.

    Raises:
        DatasetError: unknown name, missing `data_dir`, dataset not prepared, unknown split.
    """
    if not isinstance(name, str) or not name:
        raise DatasetError(f"Invalid dataset name. Received: name={name!r}. Expected {_NAMES_HELP}.")
    if data_dir is not None and not os.path.isdir(data_dir):
        raise DatasetError(
            f"`data_dir={data_dir!r}` does not exist. Expected an existing folder holding TFDS "
            "datasets (create it, or omit `data_dir` to use the default)."
        )
    if name == BUNDLED:
        return _tfds_source(name, digits.prepare(data_dir or default_data_dir()), split)
    if name.startswith("tfds:"):
        return _tfds_source(name, _tfds_builder(name, data_dir), split)
    if name.startswith("synthetic:"):
        return _synthetic_source(name, split)
    raise DatasetError(f"Unknown dataset. Received: name={name!r}. Expected {_NAMES_HELP}.")


def _tfds_builder(name, data_dir):
    tfds_name = name[len("tfds:") :]
    where = data_dir or tfds.core.constants.DATA_DIR
    how = (
        f"Prepare it on a machine with internet (`tfds build {tfds_name.split(':')[0]} "
        f"--data_dir={where}`) and copy that folder here"
    )
    try:
        builder = tfds.builder(tfds_name, data_dir=where, try_gcs=False)
    except (tfds.core.registered.DatasetNotFoundError, ValueError) as e:
        first = (str(e).strip().splitlines() or ["not found"])[0]
        raise DatasetError(f"Dataset `{name}` not found in data_dir={where!r} ({first}). {how}.") from None
    if not builder.is_prepared():
        raise DatasetError(
            f"Dataset `{name}` is not prepared in data_dir={where!r} (no {builder.data_dir}). "
            f"tfscale never downloads. {how}."
        )
    return builder


def _tfds_source(name, builder, split):
    info = builder.info
    if split not in info.splits:
        raise UnknownSplitError(
            f"Unknown split of dataset {name!r}. Received: split={split!r}. Expected one of "
            f"{sorted(info.splits)}."
        )
    split_info = info.splits[split]
    supervised = info.supervised_keys or (None, None)
    label = info.features[supervised[1]] if supervised[1] in info.features else None

    def read(shuffle_files, seed, input_context):
        config = tfds.ReadConfig(shuffle_seed=seed, input_context=input_context, try_autocache=False)
        return builder.as_dataset(split=split, shuffle_files=shuffle_files, read_config=config)

    return Source(
        name=name,
        split=split,
        num_examples=split_info.num_examples,
        num_files=split_info.num_shards,
        size_bytes=int(split_info.num_bytes),
        num_classes=getattr(label, "num_classes", 0) or 0,
        feature_key=supervised[0] or "",
        in_memory=False,
        read=read,
    )


def _synthetic_source(name, split):
    spec = synthetic.parse(name)
    data = synthetic.generate(spec)

    def read(shuffle_files, seed, input_context):
        del shuffle_files, seed, input_context  # One in-memory "file".
        return tf.data.Dataset.from_tensor_slices(data)

    return Source(
        name=name,
        split=split,
        num_examples=spec.num_examples,
        num_files=1,
        size_bytes=sum(v.nbytes for v in data.values()),
        num_classes=spec.num_classes,
        feature_key="image" if spec.kind == "images" else "tokens",
        in_memory=True,
        read=read,
    )
