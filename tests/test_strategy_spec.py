"""tfscale._strategy_spec: the one TensorFlow-free spec of the strategies (issue 29, item 2).

Each name, default and schedule rule is written once, in the spec: the flags (help,
parse-time checks) and `tfscale.strategies.get` both read it. Shown three ways: a changed
default reaches `tfscale-train --help`, the flags' checks and `get` alike; the spec imports
without TensorFlow; and no other source file writes an option's default or the schedule
rule again (an `ast` scan of every installed module).
"""

import ast
import dataclasses
import inspect
import pathlib
import re
import subprocess
import sys

import pytest
from absl import flags

import tfscale.flags
import tfscale.strategies
from tfscale import _strategy_spec as spec
from tfscale.strategies import StrategyError
from tfscale.strategies.pipeline import schedules
from tfscale.train import run

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPEC = ROOT / "tfscale" / "_strategy_spec.py"
FOLDERS = ("tfscale", "strategies", "datasets", "launch")  # setup.cfg package_dir


def _parse(*args):
    fv = flags.FlagValues()
    tfscale.flags.define_all(fv)
    fv(["prog", *args])
    return fv


def _help_line(text, flag):
    """A flag's help, its wrapped continuation lines (indented deeper) joined to the first."""
    lines = text.splitlines()
    start = next(k for k, line in enumerate(lines) if line.strip().startswith(f"--{flag}:"))
    indent = len(lines[start]) - len(lines[start].lstrip())
    more = []
    for line in lines[start + 1 :]:
        if len(line) - len(line.lstrip()) <= indent or not line.strip():
            break
        more.append(line.strip())
    return " ".join([lines[start], *more])


def test_a_changed_default_reaches_the_help_the_flags_and_get(monkeypatch, capsys):
    @dataclasses.dataclass(frozen=True)
    class Changed(spec.PipelineOptions):
        num_stages: int = 3
        num_microbatches: int = 6
        schedule: str = "gpipe"

    monkeypatch.setitem(spec.OPTIONS, "pipeline", Changed)
    assert run(["tfscale-train", "--help"]) == 0
    text = capsys.readouterr().out
    assert "(default 3)" in _help_line(text, "num_stages")
    assert "(default 6)" in _help_line(text, "num_microbatches")
    assert "(default gpipe)" in _help_line(text, "schedule")
    # The parse-time checks use it: 2 copies of 3 stages need 6 devices, and M=6 does not divide
    # a per-copy batch of 32 / 2 = 16.
    with pytest.raises(flags.IllegalFlagValueError, match=r"--num_stages=3 needs 6 devices"):
        _parse("--strategy=pipeline", "--data_parallel=2", "--cpu_replicas=4")
    with pytest.raises(flags.IllegalFlagValueError, match=r"--num_microbatches=6 does not divide .* 16"):
        _parse("--strategy=pipeline", "--global_batch_size=32", "--data_parallel=2", "--cpu_replicas=6")
    strategy = tfscale.strategies.get("pipeline", cpu_replicas=3)
    assert (strategy.num_stages, strategy.num_microbatches, strategy.schedule) == (3, 6, "gpipe")
    assert tfscale.strategies.PipelineStrategy().num_microbatches == 6  # the class, used directly


def test_the_flags_and_get_agree_with_the_spec_as_it_is(capsys):
    assert run(["tfscale-train", "--help"]) == 0
    text = capsys.readouterr().out
    options = spec.PipelineOptions()
    assert f"(default {options.num_microbatches})" in _help_line(text, "num_microbatches")
    strategy = tfscale.strategies.get("pipeline")
    assert (strategy.num_stages, strategy.num_microbatches, strategy.schedule) == (
        options.num_stages,
        options.num_microbatches,
        options.schedule,
    )
    assert tfscale.flags.STRATEGIES is spec.NAMES is tfscale.strategies.NAMES
    assert tfscale.flags.SCHEDULES == tuple(spec.SCHEDULES)


def test_zb_v_from_the_flags_needs_virtual_stages_2():
    # zb-v's entry says V is exactly 2: --virtual_stages passes it, its absence is refused
    # by the same words as the strategy's, before TensorFlow starts.
    fv = _parse("--strategy=pipeline", "--schedule=zb-v", "--virtual_stages=2", "--global_batch_size=16")
    assert tfscale.flags.strategy_args(fv) == ("pipeline", {"schedule": "zb-v", "virtual_stages": 2})
    with pytest.raises(
        flags.IllegalFlagValueError, match=r"--schedule=zb-v: .*virtual_stages=1 .*Expected 2"
    ):
        _parse("--strategy=pipeline", "--schedule=zb-v", "--global_batch_size=16")
    with pytest.raises(flags.IllegalFlagValueError, match=r"--virtual_stages expects a positive integer"):
        _parse("--strategy=pipeline", "--virtual_stages=0")


def test_a_schedule_rule_is_its_entry_for_the_flags_and_the_strategy(monkeypatch):
    monkeypatch.setitem(spec.SCHEDULES, "1f1b", spec.Schedule(rounds_of_stages=True))
    with pytest.raises(flags.IllegalFlagValueError, match=r"--schedule=1f1b: .*num_microbatches=3 with"):
        _parse("--strategy=pipeline", "--schedule=1f1b", "--num_microbatches=3", "--global_batch_size=12")
    # The registry's function carries its entry as registered; the strategy checks that one.
    monkeypatch.setattr(schedules.SCHEDULES["1f1b"], "constraints", spec.SCHEDULES["1f1b"])
    with pytest.raises(StrategyError, match=r"num_microbatches=3 with schedule='1f1b' and num_stages=2"):
        tfscale.strategies.get("pipeline", num_microbatches=3, schedule="1f1b")


def test_a_range_rule_is_its_entry_for_the_flags_and_the_strategy(monkeypatch):
    at_least_two = spec.Rule(lambda v: isinstance(v, int) and v >= 2, "an integer >= 2")
    monkeypatch.setitem(spec.RULES, "num_microbatches", at_least_two)
    with pytest.raises(flags.IllegalFlagValueError, match=r"--num_microbatches expects an integer >= 2\."):
        _parse("--strategy=pipeline", "--num_microbatches=1")
    message = (
        r"^Invalid value for argument `num_microbatches`\. Received: num_microbatches=1\. "
        r"Expected an integer >= 2\.$"
    )
    with pytest.raises(StrategyError, match=message):
        tfscale.strategies.get("pipeline", num_microbatches=1)
    with pytest.raises(StrategyError, match=message):
        tfscale.strategies.PipelineStrategy(num_microbatches=1)


def test_every_schedule_of_the_spec_has_its_function_and_the_constraints_fit_it():
    assert list(schedules.SCHEDULES) == list(spec.SCHEDULES)
    for name, function in schedules.SCHEDULES.items():
        assert function.constraints is spec.SCHEDULES[name]
        kinds = {op.kind for ops in schedules.order(name, 2, 2) for op in ops}
        assert (schedules.Kind.WEIGHT in kinds) == spec.SCHEDULES[name].weight_ops, name
    with pytest.raises(ValueError, match=r"'zigzag' has no entry in tfscale._strategy_spec.SCHEDULES"):
        schedules.register("zigzag", bubble=None, activation_bound=None)


def test_options_are_frozen_dataclasses_with_a_default_for_each():
    for name, options in spec.OPTIONS.items():
        assert dataclasses.is_dataclass(options) and options.__dataclass_params__.frozen, name
        instance = options()  # every option has a default
        if dataclasses.fields(instance):
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(instance, dataclasses.fields(instance)[0].name, None)
    assert spec.owners("data_parallel") == spec.MODEL_PARALLEL
    assert spec.expected_replicas("auto", num_workers=1, cpu_replicas=2) == 2
    assert spec.expected_replicas("auto", num_workers=1) is None  # the GPUs decide


def _as_written(value):
    return f'`"{value}"`' if isinstance(value, str) else str(value)


@pytest.mark.parametrize(
    ("name", "strategy"),
    [
        ("pipeline", tfscale.strategies.PipelineStrategy),
        ("model_split", tfscale.strategies.ModelSplitStrategy),
    ],
)
def test_help_shows_each_option_with_the_spec_default(name, strategy):
    """The classes take `**options`; their signature (help(), editors) is the spec's fields."""
    shown = {p.name: p.default for p in inspect.signature(strategy).parameters.values()}
    fields = {f.name: f.default for f in dataclasses.fields(spec.OPTIONS[name]) if f.name != "cpu_replicas"}
    assert shown == fields


def test_the_docs_state_the_spec_defaults():
    # Prose cannot read the spec: each page that states a default is held to it here.
    pipeline = spec.PipelineOptions()
    table = dict(re.findall(r"^\| `(\w+)` \| ([^|]+?) \|", (ROOT / "docs" / "pipeline.md").read_text(), re.M))
    stated = {name: table[name] for name in spec.option_names("pipeline") if name in table}
    assert len(stated) >= 10, stated  # the options table of docs/pipeline.md
    assert stated == {name: _as_written(getattr(pipeline, name)) for name in stated}
    train = (ROOT / "docs" / "train.md").read_text()
    assert f"`--num_stages S` (default {pipeline.num_stages})" in train
    assert f"`--num_microbatches M` (default {pipeline.num_microbatches}," in train
    timeout = spec.MultiWorkerOptions().cluster_timeout
    assert f"default {timeout:g};" in (ROOT / "docs" / "strategies.md").read_text()


def test_the_spec_imports_without_tensorflow():
    code = (
        "import sys, tfscale._strategy_spec, tfscale.flags; "
        "heavy = sorted(m for m in ('tensorflow', 'keras') if m in sys.modules); "
        "assert not heavy, heavy"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


# --- no default or schedule rule written outside the spec (an `ast` scan) --------------------

# The option names whose spec default is a value (a None default means "not given", not a choice).
VALUED = {
    field.name
    for options in spec.OPTIONS.values()
    for field in dataclasses.fields(options)
    if field.default is not None
}
# The pipeline's building blocks take V and recompute too; V = 1 (one chunk per device) and
# recompute=False are their plain case for direct callers, not the option's default: the
# strategy always passes its options down.
BUILDING_BLOCKS = {
    ("strategies/pipeline/schedules.py", "virtual_stages=1"),
    ("strategies/pipeline/schedules.py", "virtual_stages=2"),  # interleaved's own plain case
    ("strategies/pipeline/step.py", "virtual_stages=1"),
    ("strategies/pipeline/step.py", "recompute=False"),
    # The registry refuses a function whose name has no spec entry: the spec's set is read, not
    # restated.
    ("strategies/pipeline/schedules.py", "a check against SCHEDULES"),
}


def _names(node):
    """The option a plain expression names: `x`, `o.x`, `values["x"]`; else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return node.slice.value
    return None


def _value(node):
    return isinstance(node, ast.Constant) and node.value is not None


def _mentions(node, name):
    return any(_names(n) == name for n in ast.walk(node))


def _defaults(node):
    """A function's parameters, or a dataclass field, given a value as their default."""
    if isinstance(node, ast.AnnAssign):
        pairs = [(_names(node.target), node.value)]
    else:
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults) :], args.defaults))
        pairs = [(a.arg, d) for a, d in pairs]
        pairs += [(a.arg, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
    for name, default in pairs:
        if name in VALUED and _value(default):
            yield f"{name}={default.value!r}"


def _fallbacks(node):
    """`options.get("x", value)` and `values["x"] or value`: a default given where it is read."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        if len(node.args) == 2 and isinstance(node.args[0], ast.Constant) and _value(node.args[1]):
            if node.args[0].value in VALUED:
                yield f".get({node.args[0].value!r}, {node.args[1].value!r})"
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
        for left, right in zip(node.values, node.values[1:]):
            if _names(left) in VALUED and _value(right):
                yield f"{_names(left)} or {right.value!r}"


def _schedule_rules(node):
    """The rounds-of-S rule, or any rule keyed on a schedule's name."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        if _mentions(node.left, "num_microbatches") and _mentions(node.right, "num_stages"):
            yield "num_microbatches % num_stages (the rounds-of-S rule)"
    if isinstance(node, ast.Compare):
        if any(isinstance(n, ast.Constant) and n.value in spec.SCHEDULES for n in node.comparators):
            yield "a rule keyed on a schedule's name"


# The options whose type and range the spec states (`spec.RULES`), and its closed sets of values.
RULED = set(spec.RULES)
SPEC_SETS = {"SCHEDULES", "ZERO_STAGES", "COMMUNICATIONS", "CROSS_DEVICE_OPS", "GRADIENT_COMPRESSIONS"}
_ORDERING = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _number(node):
    return isinstance(node, ast.Constant) and type(node.value) in (int, float)


def _range_checks(node):
    """A type or range check of an option the spec has a `Rule` for, written again.

    An `if` that raises on `num_stages < 1` or on `stage not in ZERO_STAGES`, or a flag
    validator of its own (`register_validator("num_stages", ...)`): the spec's rule is read
    through `spec.option_problem` / `spec.RULES` instead. (A comparison that picks a
    behaviour, `if data_parallel > 1:`, raises nothing and is not a check.)
    """
    raises = isinstance(node, ast.If) and any(isinstance(s, ast.Raise) for s in node.body)
    for compare in ast.walk(node.test) if raises else ():
        if not isinstance(compare, ast.Compare):
            continue
        operands = [compare.left, *compare.comparators]
        named = sorted({_names(o) for o in operands} & RULED)
        if any(isinstance(op, _ORDERING) for op in compare.ops) and named and any(map(_number, operands)):
            yield f"a range check of {named[0]}"
        if any(isinstance(op, (ast.In, ast.NotIn)) for op in compare.ops):
            for name in sorted({_names(c) for c in compare.comparators} & SPEC_SETS):
                yield f"a check against {name}"
    if isinstance(node, ast.Call) and _names(node.func) == "register_validator" and node.args:
        first = node.args[0]
        if isinstance(first, ast.Constant) and first.value in RULED:
            yield f"a flag validator of {first.value}"
    # for name in ("num_stages", ...): register_validator(name, ...)
    if isinstance(node, ast.For) and isinstance(node.iter, ast.Tuple) and isinstance(node.target, ast.Name):
        calls = [n for s in node.body for n in ast.walk(s) if isinstance(n, ast.Call)]
        if any(
            _names(c.func) == "register_validator" and c.args and _names(c.args[0]) == node.target.id
            for c in calls
        ):
            for item in node.iter.elts:
                if isinstance(item, ast.Constant) and item.value in RULED:
                    yield f"a flag validator of {item.value}"


def _restated(tree):
    """Yields `(line, what)` for each option default, schedule rule or range check written in `tree`."""
    for node in ast.walk(tree):
        found = list(_fallbacks(node)) + list(_schedule_rules(node)) + list(_range_checks(node))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            found += _defaults(node)
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            found += _defaults(node)
        for what in found:
            yield node.lineno, what


def _violations(files):
    for path in files:
        where = path.relative_to(ROOT).as_posix()
        for line, what in _restated(ast.parse(path.read_text(), where)):
            if (where, what) not in BUILDING_BLOCKS:
                yield f"{where}:{line}: {what}"


def test_defaults_and_schedule_rules_are_written_only_in_the_spec():
    files = [p for folder in FOLDERS for p in sorted((ROOT / folder).rglob("*.py")) if p != SPEC]
    assert sorted(_violations(files)) == []
    # The spec itself holds what the scan looks for.
    default = f"num_microbatches={spec.PipelineOptions().num_microbatches!r}"
    assert any(v.endswith(default) for v in _violations([SPEC]))


@pytest.mark.parametrize(
    "source, found",
    [
        ("def f(*, num_microbatches=4): pass", "num_microbatches=4"),
        ("per_copy = values['num_stages'] or 2", "num_stages or 2"),
        ("m = options.get('num_microbatches', 4)", ".get('num_microbatches', 4)"),
        ("bad = self.num_microbatches % self.num_stages", "rounds-of-S"),
        ("if schedule == 'interleaved': pass", "schedule's name"),
        ("class O:\n    schedule: str = '1f1b'", "schedule='1f1b'"),
        ("if isinstance(n, int) and num_stages < 1: raise E()", "range check of num_stages"),
        ("if not 0 < options.cluster_timeout: raise E()", "range check of cluster_timeout"),
        ("if stage not in _spec.ZERO_STAGES:\n    raise E()", "check against ZERO_STAGES"),
        ("flags.register_validator('bytes_per_pack', lambda v: v >= 0)", "flag validator of bytes_per_pack"),
        ("for n in ('cpu_replicas', 'x'):\n    register_validator(n, f)", "flag validator of cpu_replicas"),
    ],
)
def test_the_scan_finds_a_restated_default_or_rule(source, found):
    assert any(found in what for _, what in _restated(ast.parse(source)))
