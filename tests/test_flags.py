"""tfscale.flags: definitions, parse-time validators, flags -> plain values, the shipped flagfiles."""

import glob
import json
import os
import re
from unittest import mock

import pytest
from absl import flags

import tfscale.flags
from tfscale.cluster import ClusterSpec

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TWO_WORKERS = json.dumps(
    {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}}
)


def _parse(*args):
    fv = flags.FlagValues()
    tfscale.flags.define_all(fv)
    fv(["prog", *args])
    return fv


def test_defaults_train_the_bundled_dataset_on_auto():
    fv = _parse()
    assert (fv.strategy, fv.dataset, fv.model, fv.global_batch_size, fv.epochs) == (
        "auto",
        "digits",
        "mlp",
        None,
        10,
    )
    assert tfscale.flags.strategy_args(fv) == ("auto", {})


def test_strategy_args_pass_only_the_options_given():
    fv = _parse("--strategy=mirrored", "--cpu_replicas=2", "--cross_device_ops=reduction_to_one_device")
    assert tfscale.flags.strategy_args(fv) == (
        "mirrored",
        {"cpu_replicas": 2, "cross_device_ops": "reduction_to_one_device"},
    )
    fv = _parse("--strategy=multi_worker", "--communication=ring")
    assert tfscale.flags.strategy_args(fv) == ("multi_worker", {"communication": "ring"})
    fv = _parse("--strategy=mirrored", "--gradient_compression=fp16", "--bytes_per_pack=0")
    assert tfscale.flags.strategy_args(fv) == (
        "mirrored",
        {"gradient_compression": "fp16", "bytes_per_pack": 0},
    )


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--strategy=horovod"], r"--strategy=horovod: value should be one of <auto\|default\|one_device"),
        (["--cpu_replicas=0"], r"--cpu_replicas expects a positive integer"),
        (["--cpu_replicas=2", "--num_gpus=2"], r"cpu_replicas.*num_gpus"),
        (["--dataset=imagenet"], r"--dataset='imagenet' is unknown\. Expected 'digits', 'tfds:"),
        (["--dataset=tfds:"], r"--dataset='tfds:' is unknown"),
        (["--data_dir=/nonexistent/tfds"], r"--data_dir='/nonexistent/tfds' does not exist"),
        (["--global_batch_size=0"], r"--global_batch_size expects a positive integer"),
        (["--global_batch_size=64", "--per_replica_batch_size=32"], r"exclude each other"),
        (
            ["--strategy=mirrored", "--cpu_replicas=4", "--global_batch_size=66"],
            r"66 is not divisible by the 4",
        ),
        (
            ["--model=resnet"],
            r"--model='resnet' is unknown\. Expected one of \['mlp', 'cnn', 'transformer'\]",
        ),
        (["--epochs=0"], r"--epochs"),
        (
            ["--gradient_compression=int8"],
            r"--gradient_compression=int8: value should be one of <fp16\|bf16>",
        ),
        (["--bytes_per_pack=-1"], r"--bytes_per_pack expects an integer >= 0"),
        (["--profile_steps=5:2"], r"--profile_steps='5:2'\. Expected A:B, whole numbers with 1 <= A <= B"),
        (["--profile_steps=x"], r"--profile_steps='x'\. Expected A:B"),
        (["--profile_steps=-1:3"], r"--profile_steps='-1:3'\. Expected A:B"),
        (["--profile_steps=0:3"], r"--profile_steps='0:3'\. Expected A:B"),
        (["--profile_steps=3"], r"--profile_steps='3'\. Expected A:B"),
        (["--learning_rate=-1"], r"--learning_rate expects a positive, finite number"),
        (["--mixed_precision=fp8"], r"--mixed_precision=fp8: value should be one of"),
        (["--backup_freq=often"], r"--backup_freq='often'\. Expected 'epoch' or a positive number"),
        (["--tf_config={bad json"], r"--tf_config"),
        (
            ["--tf_config=/nonexistent.json"],
            r"--tf_config='/nonexistent.json' is neither JSON nor an existing file",
        ),
    ],
)
def test_bad_flags_fail_at_parse_time_naming_the_flag(args, match):
    with pytest.raises(flags.IllegalFlagValueError, match=match):
        _parse(*args)


@pytest.mark.parametrize(
    ("args", "environ", "replicas"),
    [
        (["--strategy=one_device"], {}, 1),
        (["--strategy=mirrored", "--cpu_replicas=3"], {}, 3),
        (["--strategy=mirrored"], {}, None),  # all GPUs: only TensorFlow can count them
        (["--strategy=multi_worker", "--cpu_replicas=2"], {"TF_CONFIG": TWO_WORKERS}, 4),
        (["--cpu_replicas=2", f"--tf_config={TWO_WORKERS}"], {}, 4),
        (["--strategy=multi_worker"], {"TF_CONFIG": TWO_WORKERS}, None),
        # auto's own rule: a named TPU wins over cpu_replicas, so the flags cannot tell.
        (["--cpu_replicas=2"], {"TPU_NAME": "my-tpu"}, None),
        (["--cpu_replicas=2", "--tpu=my-tpu"], {}, None),
        (["--cpu_replicas=1"], {}, 1),
    ],
)
def test_expected_replicas_from_flags_alone(args, environ, replicas):
    fv = _parse(*args)
    values = {name: fv[name].value for name in ("strategy", "cpu_replicas", "num_gpus", "tpu", "tf_config")}
    assert tfscale.flags.expected_replicas(values, environ) == replicas


def test_batch_split_check_reads_the_cluster_from_the_environment():
    with mock.patch.dict(os.environ, {"TF_CONFIG": TWO_WORKERS}):
        with pytest.raises(
            flags.IllegalFlagValueError, match=r"--global_batch_size=65 is not divisible by the 2"
        ):
            _parse("--strategy=multi_worker", "--cpu_replicas=1", "--global_batch_size=65")


def test_cluster_spec_from_flag_file_or_environment(tmp_path):
    want = ClusterSpec.from_tf_config(TWO_WORKERS)
    path = tmp_path / "tf_config.json"
    path.write_text(TWO_WORKERS)
    assert tfscale.flags.cluster_spec(_parse(f"--tf_config={TWO_WORKERS}"), environ={}) == want
    assert tfscale.flags.cluster_spec(_parse(f"--tf_config={path}"), environ={}) == want
    assert tfscale.flags.cluster_spec(_parse(), environ={"TF_CONFIG": TWO_WORKERS}) == want
    assert tfscale.flags.cluster_spec(_parse(), environ={}) is None


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(REPO, "flagfiles", "*.cfg"))))
def test_shipped_flagfiles_parse(path):
    fv = _parse(f"--flagfile={path}")
    assert fv.strategy == os.path.basename(path)[: -len(".cfg")]
    assert fv.global_batch_size == 64  # one global batch for all, so the metrics agree


def test_flagfiles_exist_for_each_strategy_the_readme_uses():
    names = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "flagfiles", "*.cfg"))}
    assert {"one_device.cfg", "mirrored.cfg", "multi_worker.cfg"} <= names


# --- the cluster-source flags: one definition, one meaning in every binary -----------------------


def _binary_flags():
    from tfscale import cluster_cli
    from tfscale.launch import launcher

    defined = {}
    for name, define in (
        ("tfscale-launch", launcher.define_flags),
        ("tfscale-tfconfig", cluster_cli.define_flags),
    ):
        fv = flags.FlagValues()
        define(fv)
        defined[name] = fv
    return defined


def test_cluster_source_flags_mean_the_same_in_every_binary():
    launch, tfconfig = _binary_flags().values()
    shared = [n for n in tfscale.flags.CLUSTER_SOURCE_FLAGS if n in launch and n in tfconfig]
    assert {"hosts", "hostfile", "port", "chief", "evaluator"} <= set(shared)
    for name in [*shared, "workers"]:
        a, b = launch[name], tfconfig[name]
        assert (type(a.parser), a.help, a.default, a.boolean) == (
            type(b.parser),
            b.help,
            b.default,
            b.boolean,
        )
    for fv in (launch, tfconfig):
        fv(["prog", "--workers=a,b:2", "--chief", "--evaluator=e:3000"])
        assert (fv.hosts, fv.chief, fv.evaluator) == (["a", "b:2"], True, "e:3000")
        fv.unparse_flags()
        fv(["prog", "--chief=node0", "--noevaluator"])
        assert (fv.chief, fv.evaluator) == ("node0", False)


def test_chief_takes_one_host_or_a_switch():
    launch = _binary_flags()["tfscale-launch"]
    with pytest.raises(
        flags.IllegalFlagValueError, match=r"--chief=a,b: expected one host\[:port\] or true/false"
    ):
        launch(["prog", "--chief=a,b"])


def test_no_binary_defines_flags_when_imported():
    import subprocess
    import sys

    code = (
        "import sys; from absl import flags\n"
        "import tfscale.cluster_cli, tfscale.launch.launcher, tfscale.train\n"
        "found = [n for n in ('from', 'hosts', 'chief', 'num_workers', 'strategy') if n in flags.FLAGS]\n"
        "sys.exit(f'defined at import: {found}' if found else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


# --- one registry per kind of name, and the docs' flag table (docs/train.md) lists it ---------


def _readme_choices(flag):
    with open(os.path.join(REPO, "docs", "train.md")) as f:
        text = f.read()
    match = re.search(rf"`--{flag}` (\w+(?:\\\|\w+)+)", text)
    assert match, f"--{flag} is not in the flag table of docs/train.md"
    return match.group(1).split("\\|")


def test_readme_flag_table_lists_each_registry():
    from tfscale import models

    assert _readme_choices("strategy") == list(tfscale.flags.STRATEGIES)
    assert _readme_choices("model") == list(models.MODELS) == list(tfscale.flags.MODELS)
    assert _readme_choices("optimizer") == list(tfscale.flags.OPTIMIZERS)


def test_every_registered_optimizer_is_a_keras_optimizer():
    import keras

    for name, class_name in tfscale.flags.OPTIMIZERS.items():
        assert issubclass(getattr(keras.optimizers, class_name), keras.optimizers.Optimizer), name
