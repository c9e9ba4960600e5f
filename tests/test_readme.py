"""Every code block of README.md and of the site's pages (docs/*.md), run as written in a fresh
process (or listed below with why not).

`SNIPPETS` is the fixture: for each block (found by a line it contains, on its `page`) what it
needs that the page leaves to the reader -- names defined before it (`setup`), files in its working
directory, stand-ins for programs that do not exist here (`sbatch`, `kubectl`, `ssh`,
`srun`), and `fill`: placeholders such as `[...]` replaced by a concrete value. The block's
text itself is never edited here: a page change that breaks an example fails its test, and a
block that is not in the table fails `test_every_block_is_in_the_table`.
"""

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

# The fast tier keeps the first N cases of these parametrized tests; the rest run in the
# full suite only (conftest.py, `FAST_REPRESENTATIVES`).
FAST_REPRESENTATIVES = {
    "test_readme_block_runs_as_written": 8,
}

REPO = Path(__file__).resolve().parent.parent
# README first, then the site's pages.
PAGES = ("README.md", *sorted(f"docs/{p.name}" for p in (REPO / "docs").glob("*.md")))
BIN = Path(sys.executable).parent  # the venv's bin: tfscale-*, python, pytest


@dataclasses.dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the opening fence
    lang: str
    text: str


def readme_blocks(text=None, page="README.md"):
    """The fenced code blocks of `text` (default: the file `page`), in order."""
    lines = ((REPO / page).read_text() if text is None else text).splitlines()
    blocks, start = [], None
    for i, line in enumerate(lines):
        if line.startswith("```"):
            if start is None:
                start, lang = i, line[3:].strip()
            else:
                blocks.append(Block(start + 1, lang, "\n".join(lines[start + 1 : i]) + "\n"))
                start = None
    return blocks


@dataclasses.dataclass(frozen=True)
class Snippet:
    """How to run the block(s) that contain `key` (a `then` block runs in the same process/script)."""

    key: str
    page: str = "README.md"  # where the block is: README.md or docs/NAME.md
    run: str = "python"  # "python", "sh", or "skip" (with `why`)
    why: str = ""
    setup: str = ""  # Python run before the block (python), or files written first (see `files`)
    fill: tuple = ()  # (placeholder, value): each placeholder must occur in the block
    files: tuple = ()  # (name, text) written into the working directory
    then: tuple = ()  # keys of blocks run after this one, in the same process (python) or script (sh)
    file_from: Optional[tuple] = None  # (key of a text block, file name): that block becomes a file
    check: str = ""  # a regex every line of which must match, in order, a line of the output
    expect_error: str = ""  # the block must fail with this in its output (documented behaviour)
    env: tuple = ()
    marks: tuple = ()
    timeout: int = 300
    same_as: Optional[tuple] = None  # (page, key): a skipped copy of a block run there, kept equal


# No TensorFlow op runs here: the pages' flows call `tfscale.strategies.get` first (it may
# still split the CPU), so a block given a ready `model` is filled with `make_model()`.
_MODEL = """
import keras, numpy as np
keras.utils.set_random_seed(0)
def make_model():
    layers = [keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)]
    model = keras.Sequential(layers)
    model.compile(optimizer="sgd", loss="mse")
    return model
x = np.random.default_rng(0).normal(size=(256, 4)).astype("float32")
y = x.sum(axis=1, keepdims=True)
"""

# Stand-ins for programs this machine does not have; each checks what it is given.
_SBATCH = "#!/bin/sh\nbash -n \"$1\" && grep -q 'srun' \"$1\" && echo 'Submitted batch job 1'\n"
_KUBECTL = (
    f"#!{sys.executable}\nimport sys, yaml\n"
    "doc = yaml.safe_load(open(sys.argv[sys.argv.index('-f') + 1]))\n"
    "assert sys.argv[1] == 'apply' and doc['kind'] == 'TFJob', doc\n"
    "print('tfjob.kubeflow.org/train created')\n"
)
# ssh HOST... COMMAND: runs COMMAND here (every "host" is this machine).
_SSH = (
    '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do case $1 in -o) shift 2;; *) shift;; esac; done\n'
    'shift\nexec sh -c "$*"\n'
)
# srun OPTIONS... COMMAND: one Slurm task (the Slurm variables are in the block's environment).
_SRUN = '#!/bin/sh\nwhile [ "${1#--}" != "$1" ]; do shift; done\nexec env SLURM_PROCID=0 "$@"\n'
_TRAIN_PY = "import json, os\nprint('task', json.loads(os.environ['TF_CONFIG'])['task'], flush=True)\n"
_PS_TRAIN_PY = (
    "import json, os, time\ntask = json.loads(os.environ['TF_CONFIG'])['task']\n"
    "print('task', task, flush=True)\n"
    "if task['type'] != 'chief':\n    time.sleep(600)  # parameter servers and workers serve until stopped\n"
)
_SLURM_ENV = (
    ("SLURM_JOB_ID", "1"),
    ("SLURM_JOB_NODELIST", "localhost"),
    ("SLURM_TASKS_PER_NODE", "1"),
    ("SLURM_NTASKS", "1"),
)
_TRAIN_OUTPUT_KEY = "trained 10 epochs x 24 steps in"

SNIPPETS = [
    Snippet(
        "python3 -m venv .venv && . .venv/bin/activate",
        run="skip",
        why="a new venv and the whole suite: that is `bash .ci/run`; `tfscale-train` runs below",
    ),
    Snippet(
        'strategy = tfscale.strategies.get("auto")          # or',
        page="docs/strategies.md",
        setup="import tensorflow as tf\n"
        "dataset = tf.data.Dataset.from_tensor_slices(([[1.0, 2.0]] * 64, [[3.0]] * 64)).batch(16)\n",
        fill=(
            ("keras.Sequential([...])", "keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])"),
            ("model.compile(...)", 'model.compile(optimizer="sgd", loss="mse")'),
        ),
    ),
    Snippet(
        "from tfscale.cluster import ClusterSpec, ClusterSpecError",
        page="docs/cluster.md",
        setup='text_or_dict = \'{"cluster": {"worker": ["a:2222", "b:2222"]}}\'\n',
        env=(("TF_CONFIG", '{"cluster": {"worker": ["a:2222"]}, "task": {"type": "worker", "index": 0}}'),),
        then=('ClusterSpec.from_hosts(workers=["10.0.0.1"',),
    ),
    Snippet(
        'ClusterSpec.from_hosts(workers=["10.0.0.1"',
        page="docs/cluster.md",
        run="skip",
        why="runs after the block above",
    ),
    Snippet(
        "node2 slots=4   # same GPUs",
        page="docs/cluster.md",
        run="skip",
        why="a hostfile: written as `hosts` for the block after it",
    ),
    Snippet(
        "tfscale-tfconfig --from=hostfile --hostfile=hosts",
        page="docs/cluster.md",
        run="sh",
        file_from=("node2 slots=4   # same GPUs", "hosts"),
        check=r"\A(\{\"cluster\".*\n){8}\Z",  # "8 lines, one TF_CONFIG each"
    ),
    Snippet(
        "tfscale-tfconfig --sbatch=train.sbatch",
        page="docs/cluster.md",
        run="sh",
        files=(("bin/sbatch", _SBATCH),),
    ),
    Snippet(
        "tfscale-tfconfig --tfjob=train.yaml",
        page="docs/cluster.md",
        run="sh",
        files=(("bin/kubectl", _KUBECTL),),
    ),
    Snippet(
        'backup = tfscale.callbacks.BackupAndRestore("/shared/run1/backup"',
        page="docs/backups.md",
        setup=_MODEL,
        fill=(('"/shared/run1/backup"', '"run1/backup"'),),
    ),
    Snippet(
        "tfscale-launch --num_workers 2 -- python train.py                      # 2 workers",
        page="docs/launch.md",
        run="sh",
        files=(
            ("train.py", _TRAIN_PY),
            ("ps_train.py", _PS_TRAIN_PY),
            ("hosts.txt", "node1 slots=2\n"),
            ("bin/ssh", _SSH),
            ("bin/srun", _SRUN),
        ),
        # The last line trains TensorFlow's tutorial on 2 workers (25 s of CI): that exact command,
        # main.py unchanged under `tfscale-launch --num_workers 2 --keras_compat`, is run and
        # checked further (every worker's weights, the fixes applied, 3 epochs) by
        # tests/test_launch_training.py::test_tutorial_main_runs_unchanged_on_2_workers_with_keras_compat.
        # The fill fails here if the page's line changes, so the two stay the same command.
        fill=(
            (
                "cd examples/multi_worker_tutorial && "
                "tfscale-launch --num_workers 2 --keras_compat -- python main.py",
                "test -f examples/multi_worker_tutorial/main.py  # trained in test_launch_training.py",
            ),
        ),
        env=_SLURM_ENV,
    ),
    Snippet(
        "worker:1 failed (signal SIGKILL) in attempt 1",
        page="docs/launch.md",
        run="skip",
        why="example output",
    ),
    Snippet(
        'strategy = tfscale.strategies.get("auto", cpu_replicas=2)',
        check=r"Epoch 2/2",
    ),
    Snippet(
        "tfscale-train                       # no flags",
        run="sh",
        then=(_TRAIN_OUTPUT_KEY,),
    ),
    Snippet(_TRAIN_OUTPUT_KEY, run="skip", why="the output the block above is checked against"),
    Snippet(
        "tfscale-train                       # no flags",
        page="docs/train.md",
        run="skip",
        why="the README's tfscale-train example, run and checked there",
        same_as=("README.md", "tfscale-train                       # no flags"),
    ),
    Snippet(
        _TRAIN_OUTPUT_KEY,
        page="docs/train.md",
        run="skip",
        why="the README's output of that example, checked there",
        same_as=("README.md", _TRAIN_OUTPUT_KEY),
    ),
    Snippet(
        "--max_restarts 1 -- python train.py   # 2 workers on loopback",
        run="sh",
        files=(("train.py", _TRAIN_PY),),
        # Both tasks ran, each with its own TF_CONFIG: the stand-in prints the task it was given.
        check=r"(?s)(?=.*'type': 'worker', 'index': 0\})(?=.*'type': 'worker', 'index': 1\})",
    ),
    Snippet(
        'tfscale.strategies.get("mirrored", cpu_replicas=2, zero_stage=',
        page="docs/zero.md",
        # The bytes the page explains: a full copy of the parameters, 1/2 of Adam's state.
        check=r"(?s)CPU:0': \{'parameters': 264, 'optimizer': 432, "
        r".*CPU:1': \{'parameters': 264, 'optimizer': 432, ",
    ),
    # Run as written on one rank (size 1) here; the launch line below runs it on two.
    Snippet("import tfscale.horovod as hvd  # was:", page="docs/horovod.md", check=r"Epoch 2/2"),
    Snippet(
        "tfscale-launch -np 2 python train.py",
        page="docs/horovod.md",
        run="sh",
        file_from=("import tfscale.horovod as hvd  # was:", "train.py"),
        check=r"\[worker:0\] Epoch 2/2",  # rank 0 prints; the job fails if either rank fails
        marks=(pytest.mark.slow,),  # a 2-process cluster: ~30 s
    ),
    Snippet(
        "tfscale-train --strategy=mirored",
        page="docs/reliability.md",
        run="sh",
        expect_error="tfscale-train: error:",
    ),
    Snippet(
        "lambda: StepTimer(global_batch_size=0),",
        page="docs/reliability.md",
        # The three lines the page shows after it, in order, exactly.
        check=r"\ACallbackError \| Invalid value for argument `global_batch_size`\. Received: "
        r"global_batch_size=0\. Expected a positive integer\.\n"
        r"CallbackError \| Invalid value for argument `initial_lr`\. Received: initial_lr=-1\.0\. "
        r"Expected a non-negative finite number\.\n"
        r"StrategyError \| Invalid value for argument `schedule`\. Received: schedule='pipedream'\. "
        r"Expected one of \['gpipe', '1f1b', 'interleaved', 'zb-h1', 'zb-v'\]\.\n",
    ),
    Snippet(
        "CallbackError | Invalid value for argument `global_batch_size`.",
        page="docs/reliability.md",
        run="skip",
        why="the output of the block above, checked there (its `check`)",
    ),
    Snippet(
        "python bench/bench_scaling.py --quick",
        page="docs/benchmarks.md",
        run="skip",
        why="a bench script, run by hand (minutes, not a test): its figures are this page's scaling table",
    ),
    Snippet(
        "tfscale.compat.apply_strategy_fixes()              # once",
        page="docs/keras-multi-worker.md",
    ),
    Snippet(
        "tfscale-train --flagfile=flagfiles/one_device.cfg",
        page="docs/train.md",
        run="skip",
        # Running the block here took 68 s of CI for nothing more than those tests check.
        why="its first three commands run as written, results compared, in "
        "tests/test_train_flags.py (same metrics as one device); the kill-and-resume line's "
        "flags (2 epochs instead of the flagfile's 10) in tests/test_train.py (killed at step "
        "40 under the launcher, resumed: the uninterrupted weights)",
    ),
    Snippet(
        'ds = tfscale.datasets.load("digits", "train", global_batch_size=64',
        page="docs/train.md",
        setup="import keras, tfscale, tfscale.models\nstrategy = tfscale.strategies.get('auto')\n"
        "with strategy.scope():\n    model = tfscale.models.build('mlp', (8, 8, 1), 10)\n"
        "    model.compile('adam', keras.losses.SparseCategoricalCrossentropy(from_logits=True))\n",
        # tfscale never downloads: the documented answer for an unprepared TFDS dataset
        # (in an existing, empty data_dir: a missing one is its own one-line error).
        files=(("tfds/.keep", ""),),
        fill=(('data_dir="/data/tfds"', 'data_dir="tfds"'),),
        expect_error="tfds build mnist",
    ),
    Snippet(
        'num_stages=2, num_microbatches=8, schedule="1f1b"',
        page="docs/pipeline.md",
        setup=_MODEL,
        fill=(("strategy.split(model)", "strategy.split(make_model())"),),
    ),
    Snippet(
        'strategy = tfscale.strategies.get("model_split", num_devices=2)',
        page="docs/model-split.md",
        setup=_MODEL,
        fill=(("strategy.split(model)", "strategy.split(make_model())"),),
    ),
    Snippet(
        "--data_parallel=2 --cpu_replicas=4 --global_batch_size=32 --epochs=3 --plan_report",
        page="docs/hybrid.md",
        run="skip",
        why="tests/test_train_model_parallel.py trains these flags in process (a binary costs 15-20 s)",
    ),
    Snippet(
        "plan: S=2 M=4 D=2, micro-batch 4 samples",
        page="docs/hybrid.md",
        run="skip",
        why="sample output of the block above",
    ),
    Snippet(
        "num_microbatches=4, data_parallel=2)",
        page="docs/hybrid.md",
        setup=_MODEL + "import tfscale\n",
        fill=(("split(model)", "split(make_model())"),),
    ),
    Snippet(
        "from tfscale.launch.elastic import elastic_batch",
        page="docs/launch.md",
        # `build_model` is the reader's; this one reads the block's `lr` when called.
        setup="import keras, tfscale.models\n"
        "def build_model():\n"
        "    model = tfscale.models.build('mlp', (8, 8, 1), 10)\n"
        "    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)\n"
        "    model.compile(keras.optimizers.Adam(lr), loss)\n"
        "    return model\n",
        fill=(("/shared/backup", "backup"),),
        timeout=600,
    ),
    Snippet(
        "--num_workers 2:4 --max_restarts 5 --host_discovery",
        page="docs/launch.md",
        run="skip",
        why="an elastic 2-4 worker job around the recipe above (tests/test_elastic.py runs this path)",
    ),
    Snippet(
        'gradient_compression="fp16",  # or "bf16", None', page="docs/optimizers.md", setup="import tfscale\n"
    ),
    Snippet(
        "--num_workers 2:4 --max_restarts 3 -- tfscale-train",
        page="docs/launch.md",
        run="skip",
        why="elastic jobs on 2-4 workers and on hosts node1/node2: tests/test_elastic.py runs both paths",
    ),
    Snippet(
        "elastic: running at 3 workers (start)",
        page="docs/launch.md",
        run="skip",
        why="sample launcher output",
    ),
    Snippet(
        "--profile_steps=5:12 --model_dir=run",
        page="docs/optimizers.md",
        run="sh",
        check=r"communication-local\.json\ncommunication\.png\nlocal\ntrace-local\.json\.gz",
    ),
    Snippet(
        "--steps_per_epoch=8 --profile_steps=4:6 --model_dir=run2",
        page="docs/optimizers.md",
        run="sh",
        # The files the page lists (the chief's trace only) and the other worker's log line.
        check=r"(?ms)(?=.*^communication-worker-0\.json\ncommunication-worker-1\.json\n"
        r"communication\.png\ntrace-worker-0\.json\.gz\nworker-0$)"
        r"(?=.*^\[worker:1\] tfscale: [\d.]+ s/step \(steps 4-6, worker-1; not traced: )",
        marks=(pytest.mark.slow,),  # a 2-process cluster: ~10 s
    ),
    Snippet(
        "from tfscale.compat import tf_traceme_split",
        page="docs/optimizers.md",
        check=r"\AFalse\nTrue\nFalse\n",
    ),
    Snippet(
        "tests/_profiler_repro.py --runs 40",
        page="docs/optimizers.md",
        run="skip",
        why="the crash reproducer, not a test: 40 two-worker jobs take many minutes (its counts are here)",
    ),
    Snippet(
        "errors.py        tfscale.Error(ValueError)",
        page="docs/layout.md",
        run="skip",
        why="the repository layout, not code",
    ),
    Snippet(
        "capabilities    tfscale.strategies, tfscale.launch, tfscale.datasets, tfscale.horovod",
        page="docs/layout.md",
        run="skip",
        why="a diagram of the layers, not code (tests/test_layers.py checks the rule it shows)",
    ),
    Snippet(
        "print(tf_communication.compression_dtype(strategy))",
        page="docs/layout.md",
        # What the sentence after it says the block prints.
        check=r"\A<dtype: 'bfloat16'>\n300\.0 ElasticBackupAndRestore\n"
        r"\['python', 'train\.py', '--epochs=3'\]\n",
    ),
]


def _find(key, blocks, page="README.md"):
    found = [b for b in blocks if key in b.text]
    assert len(found) == 1, f"{len(found)} blocks of {page} contain {key!r}: update SNIPPETS"
    return found[0]


@pytest.mark.parametrize("page", PAGES)
def test_every_block_is_in_the_table(page):
    blocks = readme_blocks(page=page)
    covered = {_find(s.key, blocks, page).line for s in SNIPPETS if s.page == page}
    missing = [f"{page} line {b.line}: {b.text.splitlines()[0]}" for b in blocks if b.line not in covered]
    assert not missing, f"blocks with no entry in SNIPPETS: {missing}"


def _slug(heading):
    """The anchor MkDocs gives a heading (its default `toc` slugify, for the headings we write)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"[\s]+", "-", text)


def test_readme_links_point_to_pages_and_headings_that_exist():
    # mkdocs build --strict checks the site's links; the README is not part of the site.
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", (REPO / "README.md").read_text()):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        if not (REPO / path).is_file():
            broken.append(target)
        elif anchor:
            headings = re.findall(r"^#+ (.*)$", (REPO / path).read_text(), re.MULTILINE)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"README links to missing files or headings: {broken}"


def test_every_entry_names_a_site_page():
    assert not [s.key for s in SNIPPETS if s.page not in PAGES]


@pytest.mark.parametrize(
    "snippet", [s for s in SNIPPETS if s.same_as], ids=lambda s: f"{s.page}:{s.key[:30]}"
)
def test_copies_stay_equal_to_the_block_that_runs(snippet):
    page, key = snippet.same_as
    run = {(s.page, s.key) for s in _RUN} | {(s.page, k) for s in _RUN for k in s.then}
    assert (page, key) in run, f"{page}'s block {key!r} is not run: the copy is checked by nothing"
    copy = _find(snippet.key, readme_blocks(page=snippet.page), snippet.page).text
    assert copy == _find(key, readme_blocks(page=page), page).text, f"{snippet.page} differs from {page}"


def test_finds_blocks_by_fence():
    blocks = readme_blocks("text\n```python\na = 1\n```\n```sh\necho x\n```\n")
    assert [(b.line, b.lang, b.text) for b in blocks] == [(2, "python", "a = 1\n"), (5, "sh", "echo x\n")]


def _filled(snippet, block):
    text = block.text
    for placeholder, value in snippet.fill:
        assert placeholder in text, (
            f"placeholder {placeholder!r} is no longer in {snippet.page} line {block.line}"
        )
        text = text.replace(placeholder, value)
    return text


def _workdir(tmp_path, snippet, blocks):
    for name, content in snippet.files:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
        if name.startswith("bin/"):
            path.chmod(0o755)
    if snippet.file_from:
        key, name = snippet.file_from
        (tmp_path / name).write_text(_find(key, blocks, snippet.page).text)
    for shared in ("flagfiles", "examples"):  # the pages' relative paths, from a clone's root
        (tmp_path / shared).symlink_to(REPO / shared)


def _run(snippet, tmp_path, data_dir):
    blocks = readme_blocks(page=snippet.page)
    block = _find(snippet.key, blocks, snippet.page)
    _workdir(tmp_path, snippet, blocks)
    followers = [_find(k, blocks, snippet.page) for k in snippet.then]
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{BIN}:{os.environ['PATH']}",
        "TFSCALE_DATA_DIR": str(data_dir),
        "PYTHONUNBUFFERED": "1",
        **dict(snippet.env),
    }
    if "TF_CONFIG" not in dict(snippet.env):
        env.pop("TF_CONFIG", None)
    if snippet.run == "python":
        code = snippet.setup + _filled(snippet, block) + "".join(f.text for f in followers)
        argv = [sys.executable, "-c", code]
    else:
        script = "set -e\n" + _filled(snippet, block)
        argv = ["bash", "-c", script]
    run = subprocess.run(
        argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=snippet.timeout, check=False
    )
    output = run.stdout + run.stderr
    if snippet.expect_error:
        assert run.returncode != 0 and snippet.expect_error in output, output[-3000:]
        return output
    assert run.returncode == 0, f"{snippet.page} line {block.line} failed:\n{output[-5000:]}"
    if snippet.check:
        assert re.search(snippet.check, run.stdout + run.stderr), output[-3000:]
    for follower in followers:
        if snippet.run == "sh":  # an output block: its lines, numbers aside, in order
            _assert_shows(follower.text, run.stdout)
    return output


def _line_pattern(line):
    parts = re.split(r"(\{\.\.\..*?\.\.\.\}|\d+(?:\.\d+)?)", line)
    out = []
    for i, part in enumerate(parts):
        if i % 2 == 0:
            out.append(re.escape(part))
        else:
            out.append(r"\{.*\}" if part.startswith("{") else r"\d+(?:\.\d+)?")
    return "^" + "".join(out) + "$"


def _assert_shows(expected, output):
    lines = output.splitlines()
    at = 0
    for want in expected.splitlines():
        pattern = re.compile(_line_pattern(want))
        while at < len(lines) and not pattern.match(lines[at]):
            at += 1
        assert at < len(lines), f"the page shows {want!r}; not in the output (in order):\n{output[-3000:]}"
        at += 1


def test_output_check_matches_numbers_not_words():
    shown = "trained 10 epochs x 24 steps in 3.2 s\ntfscale-train-result: {...the same as JSON...}\n"
    _assert_shows(shown, 'x\ntrained 9 epochs x 24 steps in 12.25 s\ntfscale-train-result: {"a": 1}\n')
    with pytest.raises(AssertionError, match="page shows"):
        _assert_shows(shown, "trained 9 epochs of 24 steps in 12.25 s\n")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tfds")


_RUN = [s for s in SNIPPETS if s.run != "skip"]


@pytest.mark.parametrize(
    "snippet",
    [
        pytest.param(
            s, id=f"{Path(s.page).stem}:{s.run}:{re.sub(r'[^A-Za-z0-9]+', '_', s.key)[:40]}", marks=s.marks
        )
        for s in _RUN
    ],
)
def test_readme_block_runs_as_written(snippet, tmp_path, data_dir):
    _run(snippet, tmp_path, data_dir)


def test_every_skip_says_why():
    assert all(s.why for s in SNIPPETS if s.run == "skip")
