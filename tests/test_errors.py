"""tfscale.Error: the one base of every tfscale error, and what each binary makes of it."""

import importlib
import inspect
import os
import pkgutil
import subprocess
import sys
import textwrap

import pytest

import tfscale
from tfscale import errors

# Modules that act when run (exec a command); they define no classes.
_NOT_IMPORTED = {"tfscale.launch._child", "tfscale.launch._slurm_task"}
# The fault tests inject on purpose: a crash, not a report, so not a tfscale.Error.
_NOT_ERRORS = {"tfscale.callbacks.fail_at.InjectedFault"}


def _modules():
    """Every tfscale module, including the packages installed under tfscale. from other folders."""
    names = set()
    for package in ("tfscale", "tfscale.strategies", "tfscale.datasets", "tfscale.launch"):
        path = importlib.import_module(package).__path__
        names.update(info.name for info in pkgutil.walk_packages(path, package + "."))
    return sorted(names - _NOT_IMPORTED)


def _tfscale_exception_classes():
    found = {}
    for module_name in _modules():
        module = importlib.import_module(module_name)
        for name, cls in vars(module).items():
            if inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == module_name:
                found[f"{module_name}.{name}"] = cls
    return found


def test_every_tfscale_exception_is_a_tfscale_error_and_a_value_error():
    classes = _tfscale_exception_classes()
    # The walk really reached every installed package (strategies/, datasets/, launch/).
    for expected in ("StrategyError", "BalanceError", "DatasetError", "LaunchError", "UnusableBackupError"):
        assert any(path.endswith("." + expected) for path in classes), expected
    for path, cls in classes.items():
        if path in _NOT_ERRORS:
            continue
        assert issubclass(cls, tfscale.Error) and issubclass(cls, ValueError), path


def test_domain_errors_keep_their_other_bases():
    from tfscale.callbacks import UnusableBackupError
    from tfscale.launch import ClusterRunError
    from tfscale.strategies import BalanceError, ModelSplitError, StrategyError

    assert issubclass(BalanceError, StrategyError) and issubclass(ModelSplitError, StrategyError)
    assert issubclass(UnusableBackupError, OSError)
    assert issubclass(ClusterRunError, RuntimeError) and ClusterRunError.exit_status == errors.FAILED_RUN
    assert tfscale.Error.exit_status == errors.BAD_INPUT == 2


def test_importing_tfscale_for_its_error_base_imports_no_tensorflow():
    code = "import sys, tfscale; tfscale.Error; sys.exit('tensorflow' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# Each binary, with the function behind it made to raise a tfscale.Error of a multi-line
# message: one line `<prog>: error: <first line>`, the error's exit status, no traceback.
_BINARIES = {
    "tfscale-train": ("tfscale.train", "train", ["tfscale-train", "--epochs=1"]),
    "tfscale-launch": ("tfscale.launch.supervisor", "launch", ["tfscale-launch", "--", "true"]),
    "tfscale-tfconfig": ("tfscale.cluster_cli", "_print_tf_configs", ["tfscale-tfconfig", "--from=env"]),
}
_ENTRY = {"tfscale-train": "tfscale.train", "tfscale-launch": "tfscale.launch.launcher"}


def _run_binary_raising(prog, exit_status, error="Error"):
    module, function, argv = _BINARIES[prog]
    entry = _ENTRY.get(prog, "tfscale.cluster_cli")
    script = textwrap.dedent(
        f"""
        import importlib, sys
        import tfscale
        from tfscale import errors

        class Failed(tfscale.Error):
            exit_status = {exit_status}

        def fail(*args, **kwargs):
            raise {error}("first line of the message\\nsecond line, never shown")

        setattr(importlib.import_module({module!r}), {function!r}, fail)
        sys.exit(importlib.import_module({entry!r}).run({argv!r}))
        """
    )
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )


# tfscale-train starts TensorFlow before it raises (~15-50 s): its second status is the full tier's.
@pytest.mark.parametrize(
    ("exit_status", "prog"),
    [
        pytest.param(
            status,
            prog,
            id=f"{status}-{prog}",
            marks=pytest.mark.slow if (prog, status) == ("tfscale-train", errors.FAILED_RUN) else (),
        )
        for prog in sorted(_BINARIES)
        for status in (errors.BAD_INPUT, errors.FAILED_RUN)
    ],
)
def test_each_binary_turns_a_tfscale_error_into_one_line_and_its_exit_status(prog, exit_status):
    proc = _run_binary_raising(prog, exit_status, error="Failed")
    assert proc.returncode == exit_status, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if f"{prog}: error:" in line]
    assert lines == [f"{prog}: error: first line of the message"], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "second line" not in proc.stderr


@pytest.mark.parametrize("prog", sorted(_BINARIES))
def test_a_bug_that_is_no_tfscale_error_still_shows_its_traceback(prog):
    proc = _run_binary_raising(prog, 2, error="KeyError")
    assert proc.returncode not in (0, 2) and "Traceback" in proc.stderr and "KeyError" in proc.stderr
