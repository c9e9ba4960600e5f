"""Hostile input for the three binaries: every bad flag value is one line, exit 2, nothing written.

The inputs are generated, not listed: for every flag a binary defines, values are drawn
from a space picked by the flag's absl parser (wrong types, empty, huge, negative,
nan/inf, non-ASCII, newlines, undecodable bytes, a very long string) and, for flags that
name a path, from a set of hostile paths (a file where a folder is expected and back, a
path under a file, /dev/zero, /dev/full, a folder on a full or read-only tmpfs the test
mounts). Each case runs the binary's own entry point in this process (`train.parse`,
`launcher.run`, `cluster_cli.run`, catching `SystemExit`): importing TensorFlow once per
case in a subprocess would cost 5 s each. A rejected value must give the exit status 2,
exactly one line on stderr naming the flag, no traceback, nothing new on disk. Values a
flag must refuse (nan for a timeout, a negative count, ...) are asserted refused. A few
end-to-end subprocesses check that the binaries behave as their entry points do here.
"""

import contextlib
import io
import os
import re
import resource
import shutil
import subprocess
import sys
import time

import pytest
from absl import flags

from tfscale import cluster_cli, train
from tfscale import flags as tfscale_flags
from tfscale.launch import launcher

BIN = os.path.dirname(sys.executable)

# The value space of every flag, whatever its type. "\udcff" is how Python hands over an
# argv byte that is not UTF-8 (surrogateescape).
_JUNK = ["", " ", "a\nb", "é", "١٢", "²", "\udcff", "x" * 20000, "--", "1,2", "true"]
_NUMBERS = ["-1", "0", "1.5", "0x10", "9" * 30, "9" * 5000, "nan", "inf", "-inf", "1e309", "-0"]


_NAMES = {"hosts": ("hosts", "workers"), "workers": ("hosts", "workers")}


def _flag_kind(flag):
    if flag.boolean:
        return "bool"
    return {
        "IntegerParser": "int",
        "FloatParser": "float",
        "EnumParser": "enum",
        "ListParser": "list",
        "CsvListParser": "list",
    }.get(type(flag.parser).__name__, "string")


# Values particular flags must refuse besides those of their type. TensorFlow's file
# functions take UTF-8 paths only: an undecodable byte failed deep in `fit` (a traceback).
_FLAG_REFUSES = {
    ("tfscale-train", "backup_dir"): ("", " ", "\udcff"),
    ("tfscale-train", "model_dir"): ("", " ", "\udcff"),
    ("tfscale-train", "data_dir"): ("\udcff",),
    ("tfscale-launch", "log_dir"): ("", " "),
}


def _must_refuse(kind, value):
    """Whether `value` is outside what any flag of `kind` accepts."""
    if kind == "enum":
        return True  # no generated value is one of a flag's choices
    if kind == "bool":
        return value != "true"
    if kind == "float":
        # Every float flag is a rate, a time or a count of epochs: finite and >= 0.
        return value not in ("0", "-0", "1.5", "0x10", "9" * 30, "١٢")
    if kind == "int":
        # Every int flag counts something or is a port or seed: never negative, never a fraction.
        # (absl reads 0x10 as 16 and Python's int() reads '١٢' as 12, consistently.)
        return value not in ("0", "-0", "0x10", "9" * 30, "١٢")
    return False


# Flags naming a path, by what they expect there: a folder written, a folder read, a file
# read, a file written.
_PATH_FLAGS = {
    "tfscale-train": {"backup_dir": "tf_write_dir", "model_dir": "tf_write_dir", "data_dir": "read_dir",
                      "tf_config": "read_file"},
    "tfscale-launch": {"log_dir": "write_dir", "hostfile": "read_file"},
    "tfscale-tfconfig": {"hostfile": "read_file", "sbatch": "write_file", "tfjob": "write_file"},
}  # fmt: skip


def _hostile_paths(root, mounts):
    """{expectation: [path, ...]} of paths each kind of path flag must refuse, under `root`."""
    a_file = root / "a_file"
    a_file.write_text("not a folder, not a hostfile, not JSON: \xff\n")
    a_dir = root / "a_dir"
    a_dir.mkdir()
    fifo = root / "a_fifo"
    os.mkfifo(fifo)
    not_utf8 = root / "not_utf8"
    not_utf8.write_bytes(b"\xff\xfe{}\n")
    undecodable = os.fsdecode(os.fsencode(root) + b"/dir-\xff")  # exists, its name not UTF-8
    os.mkdir(undecodable)
    common = [str(a_file / "sub"), "x" * 5000]
    full, read_only, _ = mounts or (None, None, None)
    on_mounts = [os.path.join(full, "sub"), os.path.join(read_only, "sub")] if mounts else []
    paths = {
        "write_dir": [
            *common,
            str(a_file),
            "/dev/zero",
            "/dev/full",
            str(fifo),
            *on_mounts,
            *([full, read_only] if mounts else []),
        ],
        "read_dir": [*common, undecodable, str(a_file), "/dev/zero", str(fifo)],
        # /dev/zero and a FIFO as a file to read: test_endless_inputs_end_at_once, in a subprocess.
        "read_file": [*common, str(a_dir), str(not_utf8)],
        # Never /dev/* here: as root a rename there would replace the device node.
        "write_file": [*common, str(a_dir), str(fifo), *on_mounts],
    }
    # A folder TensorFlow writes (backups, TensorBoard logs): also a UTF-8 name only.
    return {**paths, "tf_write_dir": [*paths["write_dir"], undecodable]}


@pytest.fixture(scope="module")
def mounts(tmp_path_factory):
    """Small tmpfs mounts (full, read-only, empty), or None where this process may not mount."""
    base = tmp_path_factory.mktemp("mounts")
    targets = [base / "full", base / "ro", base / "empty"]
    mounted = []
    try:
        for target in targets:
            target.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(target)], check=True,
                           capture_output=True, timeout=30)  # fmt: skip
            mounted.append(target)
        with open(targets[0] / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)
        subprocess.run(
            ["mount", "-o", "remount,ro", str(targets[1])], check=True, capture_output=True, timeout=30
        )
        yield tuple(str(t) for t in targets)
    except (OSError, subprocess.SubprocessError):
        yield None  # not root, or no mount namespace rights: those cases are left out
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", str(target)], check=False, capture_output=True, timeout=30)


def _call(entry, argv):
    """Runs `entry(argv)` here as the console script would: (exit status, stdout, stderr)."""
    # Real stdout encodes strictly, stderr with backslashreplace (UTF-8 locale): so here.
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(io.BytesIO(), encoding="utf-8", errors="backslashreplace", write_through=True)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = entry(argv)
        except SystemExit as e:
            status = e.code
    return status, out.buffer.getvalue().decode("utf-8", "replace"), err.buffer.getvalue().decode("utf-8")


def _train_entry(argv):
    fv = flags.FlagValues()
    tfscale_flags.define_all(fv)
    parsed = train.parse(argv, fv)
    return parsed if isinstance(parsed, int) else 0


# Flags each case sets besides the one under test, so the value is judged in a context
# where it is used (e.g. --hostfile with --from=hostfile), per binary.
_TFCONFIG_SBATCH = ["--sbatch=job.sh", "--command=python t.py"]
_TFCONFIG_TFJOB = ["--tfjob=job.yaml", "--image=img", "--command=python t.py"]
_TFCONFIG_BASE = {
    "hostfile": ["--from=hostfile"],
    "port": ["--from=hosts", "--workers=a,b"],
    **{n: ["--from=hosts", "--workers=a,b"] for n in ("hosts", "workers", "chief", "ps", "evaluator", "task",
                                                      "format")},
    **{n: _TFCONFIG_SBATCH for n in ("sbatch", "nodes", "ntasks_per_node", "partition", "time", "command",
                                     "job_name")},
    **{n: _TFCONFIG_TFJOB for n in ("tfjob", "image", "replicas", "namespace")},
}  # fmt: skip
_LAUNCH_BASE = {
    "hosts": ["--remote_cmd=env"],
    "workers": ["--remote_cmd=env"],
    "hostfile": ["--remote_cmd=env"],
    "remote_cmd": ["--hosts=127.0.0.1"],
}

BINARIES = {
    # name: (define the flags, in-process entry, base flags per flag under test, command after --)
    "tfscale-train": (tfscale_flags.define_all, _train_entry, {}, []),
    "tfscale-launch": (launcher.define_flags, launcher.run, _LAUNCH_BASE, ["--", "true"]),
    "tfscale-tfconfig": (cluster_cli.define_flags, cluster_cli.run, _TFCONFIG_BASE, []),
}
# Flags left out of the generated cases, and why.
_SKIP = {
    "tfscale-launch": {
        "slurm": "needs a Slurm allocation (test_launch covers the refusal)",
        "host_discovery": "runs its value as a command (test_elastic covers bad commands)",
    },
}


def _flag_cases():
    for prog, (define, _, _, _) in BINARIES.items():
        fv = flags.FlagValues()
        define(fv)
        for name, flag in sorted(fv._flags().items()):
            alias = name != flag.name or (flag.help or "").startswith("Alias for --")  # absl's DEFINE_alias
            if not alias and name not in _SKIP.get(prog, {}):  # an alias: tested under its target's name
                yield pytest.param(prog, name, _flag_kind(flag), id=f"{prog}--{name}")


def _snapshot(*roots):
    return sorted(os.path.join(d, f) for root in roots for d, ds, fs in os.walk(root) for f in ds + fs)


def _check_refusal(prog, names, status, out, err):
    lines = err.splitlines()
    assert status == 2, (status, out[-500:], err[-2000:])
    assert "Traceback" not in err + out
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"{prog}: error: "), lines[0][:300]
    assert any(re.search(rf"\b{n}\b", lines[0]) for n in names), lines[0][:300]


def _argv(prog, name, value):
    _, _, base, command = BINARIES[prog]
    return [
        prog,
        *[a for a in base.get(name, []) if not a.startswith(f"--{name}=")],
        f"--{name}={value}",
        *command,
    ]


def _values(kind):
    return _JUNK + (_NUMBERS if kind not in {"enum", "bool"} else [])


# One test a flag, its values in a loop: a pytest case a value would cost more than the value.
@pytest.mark.parametrize(("prog", "name", "kind"), list(_flag_cases()))
def test_generated_bad_values(prog, name, kind, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in _values(kind):
        status, out, err = _call(BINARIES[prog][1], _argv(prog, name, value))
        assert "Traceback" not in err + out, (value, err[-3000:])
        if status == 2 or _must_refuse(kind, value) or value in _FLAG_REFUSES.get((prog, name), ()):
            _check_refusal(prog, _NAMES.get(name, (name,)), status, out, err)
            assert _snapshot(tmp_path) == [], value
        else:
            assert status in (0, 1), (value, status, err[-2000:])
        for entry in os.listdir(tmp_path):  # an accepted value may write (a job file): start clean
            path = tmp_path / entry
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _path_cases():
    for prog, path_flags in _PATH_FLAGS.items():
        for name, expects in sorted(path_flags.items()):
            yield pytest.param(prog, name, expects, id=f"{prog}--{name}")


@pytest.mark.parametrize(("prog", "name", "expects"), list(_path_cases()))
def test_generated_bad_paths(prog, name, expects, tmp_path, mounts, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    paths = _hostile_paths(tmp_path, mounts)[expects]
    roots = [tmp_path, *(mounts[:2] if mounts else ())]
    for path in paths:
        before = _snapshot(*roots)
        status, out, err = _call(BINARIES[prog][1], _argv(prog, name, path))
        _check_refusal(prog, _NAMES.get(name, (name,)), status, out, err)
        assert _snapshot(*roots) == before, path


def _flagfiles(root):
    """{what: flagfile path} of flagfiles every binary must refuse in one line, without hanging."""
    files = {
        "not UTF-8": b"--epochs=1\n# \xff\xfe\n",
        "a junk line": b"--epochs=1\njunk line\n",
        "too big": b"# " + b"x" * (2 << 20) + b"\n",
        "includes itself": b"--flagfile=" + str(root / "includes itself").encode() + b"\n",
    }
    paths = {}
    for what, data in files.items():
        (root / what).write_bytes(data)
        paths[what] = str(root / what)
    return {**paths, "a folder": str(root), "missing": str(root / "missing")}


@pytest.mark.parametrize("prog", list(BINARIES))
def test_bad_flagfiles_are_one_line_and_bounded(prog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, entry, _, command = BINARIES[prog]
    for what, path in _flagfiles(tmp_path).items():
        before = _snapshot(tmp_path)
        start = time.monotonic()
        status, out, err = _call(entry, [prog, f"--flagfile={path}", *command])
        assert time.monotonic() - start < 5, what  # /dev/zero read whole would never end
        _check_refusal(prog, ("flagfile",), status, out, err)
        assert _snapshot(tmp_path) == before, what


# Files whose whole read never ends (or whose open blocks): were such a read back, an
# in-process case would eat this process's memory, so each runs as the real binary,
# bounded in memory and time.
_ENDLESS = {
    "tfscale-train": [("--flagfile={}",), ("--tf_config={}",)],
    "tfscale-launch": [("--flagfile={}", "--", "true"), ("--hostfile={}", "--", "true")],
    "tfscale-tfconfig": [("--flagfile={}",), ("--from=hostfile", "--hostfile={}")],
}


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


@pytest.mark.parametrize("prog", list(_ENDLESS))
def test_endless_inputs_end_at_once(prog, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    nested = tmp_path / "nested.cfg"
    nested.write_text("--flagfile=/dev/zero\n")
    for args in _ENDLESS[prog]:
        for path in ("/dev/zero", str(fifo), *([str(nested)] if "flagfile" in args[0] else [])):
            argv = [os.path.join(BIN, prog), *(a.format(path) for a in args)]
            proc = subprocess.run(argv, capture_output=True, text=True, cwd=tmp_path, timeout=20,
                                  preexec_fn=_limit_memory, check=False)  # fmt: skip
            name = next(a for a in args if "{}" in a).split("=")[0].lstrip("-")
            _check_refusal(prog, (name,), proc.returncode, proc.stdout, proc.stderr)
            assert sorted(os.listdir(tmp_path)) == ["fifo", "nested.cfg"]


def test_stray_arguments_are_refused_not_ignored():
    status, _, err = _call(_train_entry, ["tfscale-train", "--epochs=1", "epochs=2"])
    assert (
        status == 2
        and err == "tfscale-train: error: Unexpected argument 'epochs=2'. Expected only --flags.\n"
    )


def test_num_workers_beyond_the_task_limit_is_refused_before_anything_starts(tmp_path):
    status, out, err = _call(launcher.run, ["tfscale-launch", f"--num_workers={10**9}", "--", "true"])
    _check_refusal("tfscale-launch", ("num_workers",), status, out, err)


def test_log_dir_that_cannot_hold_a_log_is_one_line_before_any_task_starts(tmp_path):
    (tmp_path / "logs" / "worker-0.log").mkdir(parents=True)  # a folder named like the log
    ran = tmp_path / "ran"
    argv = ["tfscale-launch", f"--log_dir={tmp_path / 'logs'}", "--", "touch", str(ran)]
    status, out, err = _call(launcher.run, argv)
    _check_refusal("tfscale-launch", ("log_dir",), status, out, err)
    assert "worker-0.log" in err and not ran.exists()


def test_log_dir_filling_up_mid_run_drops_the_log_but_never_blocks_the_task(mounts):
    if mounts is None:
        pytest.skip("needs a tmpfs mount (root)")
    # 2 MB of output into a 64 KiB file system: once it is full, the task must still run
    # to its end (a reader that stopped reading would leave it blocked on a full pipe).
    code = "import sys\nfor _ in range(2000): print('x' * 1000)\nprint('done', file=sys.stderr)"
    argv = ["tfscale-launch", f"--log_dir={mounts[2]}", "--task_timeout=60", "--", sys.executable, "-c", code]
    status, out, err = _call(launcher.run, argv)
    assert status == 0, err
    assert "No space left on device" in out and "output is dropped" in out
    assert "Traceback" not in out + err


# `tfscale.strategies.get`: every option of the strategies that build in this process
# without a cluster or a TPU, each given values of the wrong type or naming devices this
# machine does not have. The answer is a strategy or one StrategyError line naming it.
_STRATEGY_VALUES = ["2", 2.5, True, -1, 0, float("nan"), [], "CPU:0", "/cpu:99", "/gpu:7", ["/cpu:99"],
                    ["/gpu:7"], [1, 2], {"a": 1}, object(), "x" * 10000]  # fmt: skip


def _strategy_options():
    from tfscale import _strategy_spec

    for name in ("one_device", "mirrored", "pipeline", "model_split"):
        yield from ((name, option) for option in _strategy_spec.option_names(name))


@pytest.mark.parametrize(("name", "option"), list(_strategy_options()))
def test_strategy_options_of_the_wrong_type_are_one_strategy_error(name, option):
    import tfscale

    for value in _STRATEGY_VALUES:
        try:
            # A model split needs its size; the option under test replaces it where it gives it.
            sized = name != "model_split" or option in ("devices", "num_devices")
            base = {} if sized else {"num_devices": 2}
            tfscale.strategies.get(name, **base, **{option: value})
        except tfscale.strategies.StrategyError as e:
            message = str(e)
            assert "\n" not in message and option in message, (value, message)
        except Exception as e:
            pytest.fail(f"{name}({option}={value!r}): {type(e).__name__}: {str(e)[:300]}")
        else:
            missing = ("/cpu:99", "/gpu:7", ["/cpu:99"], ["/gpu:7"])  # no such device here
            assert not (option in ("devices", "device") and value in missing), value


@pytest.mark.parametrize("name", [3, None, ["mirrored"], "", "mirrored\n"])
def test_strategy_names_of_the_wrong_type_are_one_strategy_error(name):
    import tfscale

    with pytest.raises(tfscale.strategies.StrategyError, match=r"^Unknown strategy name\. Received: name="):
        tfscale.strategies.get(name)


def test_tpu_option_of_the_wrong_type_is_one_strategy_error():
    import tfscale

    match = r"^Invalid value for argument `tpu`\. Received: tpu=5"
    with pytest.raises(tfscale.strategies.StrategyError, match=match):
        tfscale.strategies.get("tpu", tpu=5)


_FACTORIES = """
import keras


def raises(input_shape, num_classes):
    raise RuntimeError("the user's bug\\nsecond line")


def not_a_model(input_shape, num_classes):
    return [1, 2]


def no_arguments():
    return None


not_callable = 3
"""


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """The name of an importable module of bad model factories (and one that fails to import)."""
    module = f"hostile_factories_{os.getpid()}"
    (tmp_path / f"{module}.py").write_text(_FACTORIES)
    (tmp_path / f"{module}_broken.py").write_text("raise SystemError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


@pytest.mark.parametrize(
    ("attr", "match"),
    [
        ("raises", r"Model factory raised RuntimeError: the user's bug\. Received: model="),
        ("not_a_model", r"Model factory returned list\. Received: model="),
        ("no_arguments", r"Model factory raised TypeError: .*Received: model="),
        ("not_callable", r"Model factory is not callable\. Received: model="),
        ("missing", r"Cannot load model factory\. Received: model=.* \(AttributeError: "),
    ],
)
def test_bad_model_factories_are_one_model_error(factories, attr, match):
    from tfscale import models

    with pytest.raises(models.ModelError, match=match) as raised:
        models.build(f"{factories}:{attr}", (4,), 2)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("module", "match"),
    [
        ("no_such_module_anywhere", r"\(ModuleNotFoundError: No module named 'no_such_module_anywhere'\)"),
        ("{}_broken", r"\(SystemError: broken at import\)"),
        ("..relative", r"\(TypeError: "),
    ],
)
def test_model_factory_modules_that_do_not_import_are_one_model_error(factories, module, match):
    from tfscale import models

    with pytest.raises(models.ModelError, match=r"^Cannot load model factory\. Received: model=.*" + match):
        models.build(f"{module.format(factories)}:f", (4,), 2)


def test_job_files_are_written_all_or_nothing(tmp_path, mounts, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "old.sh").write_text("old\n")
    targets = [str(tmp_path / "a_dir"), str(tmp_path / "no" / "folder.yaml")]
    (tmp_path / "a_dir").mkdir()
    if mounts:
        targets.append(os.path.join(mounts[0], "job.yaml"))  # no space for the second file
    for tfjob in targets:
        for sbatch in ("new.sh", "old.sh"):
            argv = ["tfscale-tfconfig", f"--sbatch={sbatch}", f"--tfjob={tfjob}", "--image=i", "--command=x"]
            status, out, err = _call(cluster_cli.run, argv)
            _check_refusal("tfscale-tfconfig", ("tfjob",), status, out, err)
            assert sorted(os.listdir(tmp_path)) == ["a_dir", "old.sh"], tfjob
            assert (tmp_path / "old.sh").read_text() == "old\n"


def test_job_files_whose_second_rename_fails_keep_the_first_as_it_was(tmp_path, monkeypatch):
    # The rename is the one step after every check: make the second one fail for real by
    # turning its target into a folder between the staging and the renames.
    from tfscale.launch import jobfiles

    (tmp_path / "job.sh").write_text("old\n")
    stage = jobfiles._stage

    def stage_then_block(path, text, mode, staged):
        stage(path, text, mode, staged)
        if path.endswith(".yaml"):
            os.mkdir(path)
            (tmp_path / "job.yaml" / "keep").write_text("")

    monkeypatch.setattr(jobfiles, "_stage", stage_then_block)
    files = [(str(tmp_path / "job.sh"), "new\n", 0o755), (str(tmp_path / "job.yaml"), "y\n", 0o644)]
    with pytest.raises(OSError, match=r"job\.yaml"):
        jobfiles.write_all_atomic(files)
    assert (tmp_path / "job.sh").read_text() == "old\n"
    assert sorted(os.listdir(tmp_path)) == ["job.sh", "job.yaml"]


# End to end, as a user runs them: the binaries do what their entry points do above.
def test_binaries_refuse_bad_input_in_one_line_before_they_start(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    cases = [
        ("tfscale-train", f"--model_dir={a_file}", "model_dir"),
        ("tfscale-train", "--lr_warmup_epochs=inf", "lr_warmup_epochs"),
        ("tfscale-launch", f"--log_dir={a_file}", "log_dir"),
        ("tfscale-launch", "--task_timeout=nan", "task_timeout"),
        ("tfscale-tfconfig", "--port=\u0661x", "port"),
    ]
    for prog, flag, name in cases:
        command = ["--", "touch", str(tmp_path / "ran")] if prog == "tfscale-launch" else []
        proc = subprocess.run([os.path.join(BIN, prog), flag, *command], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60, check=False)  # fmt: skip
        _check_refusal(prog, (name,), proc.returncode, proc.stdout, proc.stderr)
        assert sorted(os.listdir(tmp_path)) == ["a_file"] and a_file.read_text() == "mine\n"


def test_a_model_factory_that_raises_ends_tfscale_train_with_one_line(factories, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TF_CPP_MIN_LOG_LEVEL="2")
    argv = [os.path.join(BIN, "tfscale-train"), f"--model={factories}:raises", "--epochs=1",
            "--steps_per_epoch=1", f"--model_dir={tmp_path / 'out'}"]  # fmt: skip
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr + proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tfscale-train: error: Model factory raised RuntimeError: the user's bug. ")
    assert not (tmp_path / "out").exists()
