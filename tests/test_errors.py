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


# Bad input to each public entry point that once raised a plain ValueError/RuntimeError:
# hostile values generated per kind of argument; each must end in one tfscale.Error line
# that names the value it got. Entry points are named here and imported when the case runs,
# so collecting this file imports no TensorFlow.
_ENTRIES = {
    "StepTimer": ("tfscale.callbacks", "StepTimer"),
    "LearningRateWarmup": ("tfscale.callbacks", "LearningRateWarmup"),
    "CommunicationProfiler": ("tfscale.callbacks", "CommunicationProfiler"),
    "run_local_cluster": ("tfscale.launch", "run_local_cluster"),
    "parse_num_workers": ("tfscale.launch.elastic", "parse_num_workers"),
    "order": ("tfscale.strategies.pipeline.schedules", "order"),
    "theoretical_bubble": ("tfscale.strategies.pipeline.schedules", "theoretical_bubble"),
    "stage_devices": ("tfscale.strategies.pipeline.schedules", "stage_devices"),
}
_NOT_POSITIVE_INTS = [0, -3, True, 1.5, "2", None]
_NOT_POSITIVE_NUMBERS = [0, -0.5, float("nan"), float("inf"), "0.1", True, None]


def _module_level_target():
    return 1


def _bad_calls():
    """Yields (entry, args, kwargs, text the message must hold) per entry x hostile value."""
    for v in _NOT_POSITIVE_INTS:
        yield "StepTimer", (), {"global_batch_size": v}, f"={v!r}"
        yield "StepTimer", (8,), {"num_replicas": v}, f"={v!r}"
        yield "LearningRateWarmup", (0.1, 1), {"steps_per_epoch": v}, f"={v!r}"
        yield "run_local_cluster", (_module_level_target,), {"num_workers": v}, f"={v!r}"
    for v in _NOT_POSITIVE_NUMBERS:
        yield "LearningRateWarmup", (v, 1, 10), {}, f"={v!r}"
        yield "LearningRateWarmup", (0.1, 1, 10), {"scale": v}, f"={v!r}"
        if v not in (0, None):  # a zero or no initial rate is allowed
            yield "LearningRateWarmup", (0.1, 1, 10), {"initial_lr": v}, f"={v!r}"
    for steps in [(0, 2), (3, 2), (1,), "1:2", (1.0, 2), None]:
        yield "CommunicationProfiler", ("/tmp/unused",), {"profile_steps": steps}, f"={steps!r}"
    for text in ["0", "3:2", "x", "-1", "2:", ""]:
        yield "parse_num_workers", (text,), {}, repr(text)
    for name in ["1F1B", "pipedream", None, 3]:
        yield "order", (name, 2, 4), {}, f"={name!r}"
        yield "theoretical_bubble", (2, 4, name), {}, f"={name!r}"
    yield "stage_devices", (["a", "b"], 3), {}, "3 stages"
    yield "stage_devices", ([], 2), {}, "2 stages"
    yield "run_local_cluster", (lambda: 1,), {"num_workers": 1}, "target=<function"


def _shown(value):
    """A value in a test id: a function by its name (no memory address: the same id in each xdist worker)."""
    return value.__name__ if callable(value) else repr(value)


def _bad_call_params():
    params = []
    for entry, args, kwargs, received in _bad_calls():
        shown = ", ".join([*map(_shown, args), *(f"{k}={_shown(v)}" for k, v in kwargs.items())])
        params.append(pytest.param(entry, args, kwargs, received, id=f"{entry}({shown})"))
    return params


@pytest.mark.parametrize(("entry", "args", "kwargs", "received"), _bad_call_params())
def test_bad_input_to_a_public_entry_point_is_one_tfscale_error_line(entry, args, kwargs, received):
    module, name = _ENTRIES[entry]
    function = getattr(importlib.import_module(module), name)
    with pytest.raises(tfscale.Error) as raised:
        function(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message and received in message, message


def test_a_deadlocking_schedule_and_a_non_pipelined_trace_are_tfscale_errors():
    import keras
    import numpy as np

    from tfscale.strategies import StrategyError
    from tfscale.strategies.pipeline import schedules, timeline

    backwards_first = [list(reversed(lane)) for lane in schedules.order("1f1b", 2, 2)]
    with pytest.raises(StrategyError, match=r"^The schedule deadlocks: Op\(stage=0"):
        schedules.simulate(backwards_first, dict.fromkeys(schedules.Kind, 1.0))
    plain = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    plain.compile("sgd", "mse")
    with pytest.raises(StrategyError, match=r"^Invalid value for argument `model`\. Received: model=Sequ"):
        timeline.trace_train_step(plain, np.zeros((4, 2)), np.zeros((4, 1)))
    assert issubclass(timeline.TraceError, RuntimeError)
    assert timeline.TraceError.exit_status == errors.FAILED_RUN


def test_a_keras_without_the_private_api_a_compat_module_needs_is_a_failed_run():
    from tfscale.compat import _errors, keras_compile_loss, keras_optimizer_clip

    with pytest.raises(_errors.UnsupportedVersionError, match=r"^This Keras version has no `Model\._compile"):
        keras_compile_loss.compiled_loss(object())
    with pytest.raises(_errors.UnsupportedVersionError, match=r"^This Keras optimizer has no"):
        keras_optimizer_clip.clip_norm_by_groups(object(), {}.get)
    assert issubclass(_errors.UnsupportedVersionError, (tfscale.Error, RuntimeError))
    assert _errors.UnsupportedVersionError.exit_status == errors.FAILED_RUN
