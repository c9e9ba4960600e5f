"""Imports run one way (DESIGN.md, Layout): binaries -> capabilities -> core, no cycles.

Parses every module with `ast` (imports inside functions count too); no TensorFlow import.
Binaries (top) are kept together here: tfscale/train.py, flags.py, cluster_cli.py,
models.py and launch/launcher.py.
"""

import ast
import pathlib
from xml.etree import ElementTree

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Folder -> installed package (setup.cfg package_dir).
PACKAGES = {
    "tfscale": "tfscale",
    "strategies": "tfscale.strategies",
    "datasets": "tfscale.datasets",
    "launch": "tfscale.launch",
}
BINARIES = frozenset(
    [
        "tfscale.train",
        "tfscale.flags",
        "tfscale.cluster_cli",
        "tfscale.models",
        "tfscale.launch.launcher",
    ]
)
CAPABILITIES = ("tfscale.strategies", "tfscale.launch", "tfscale.datasets", "tfscale.horovod")
CORE, CAPABILITY, BINARY = 0, 1, 2
LAYER_NAMES = {CORE: "core", CAPABILITY: "capabilities", BINARY: "binaries"}


def _modules():
    """Returns {module name: path} for every installed tfscale module."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if "_keras_compat" in parts:  # sitecustomize for children, not a module
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def _imported(name, path, modules):
    """Yields the tfscale modules `name` imports, at any depth in the file."""
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for imported in targets:
            target = imported
            while target and target not in modules:
                target = target.rpartition(".")[0]
            # A module's own packages are already loading when it runs: not an edge.
            if target and not (name + ".").startswith(target + "."):
                yield target


def _layer(module):
    if module in BINARIES:
        return BINARY
    if module.startswith(CAPABILITIES):
        return CAPABILITY
    return CORE


def _graph():
    modules = _modules()
    return {name: set(_imported(name, path, modules)) for name, path in modules.items()}


def _violations(graph):
    found = set()
    for source, targets in graph.items():
        for target in targets:
            if _layer(target) > _layer(source):
                found.add(
                    f"{source} -> {target} (up: {LAYER_NAMES[_layer(source)]} imports "
                    f"{LAYER_NAMES[_layer(target)]})"
                )
            if source.startswith("tfscale.compat") and not (
                target.startswith("tfscale.compat") or target == "tfscale.errors"
            ):
                found.add(f"{source} -> {target} (compat is a leaf: errors only)")
            owner = target.rpartition(".")[0]
            private = any(part.startswith("_") for part in target.split("."))
            if private and not source.startswith(owner + ".") and source != owner:
                if not source.startswith(_package_of(target)):
                    found.add(f"{source} -> {target} (private to {_package_of(target)})")
    for cycle in _cycles(graph):
        found.add("cycle: " + " -> ".join(cycle))
    return found


def _package_of(module):
    """The package a private module belongs to: everything before its first _part."""
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_"):
            return ".".join(parts[:i])
    return module


def _cycles(graph):
    """Yields one cycle (closed path, smallest module first) per strongly connected set."""
    index, low, stack, on_stack, result = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(_path_in(sorted(component), graph))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return result


def _path_in(component, graph):
    """A shortest cycle through the component's first module, as a closed path."""
    members, start = set(component), component[0]
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for nxt in sorted(graph[path[-1]] & members):
            if nxt == start:
                return [*path, start]
            if nxt not in seen:
                seen.add(nxt)
                paths.append([*path, nxt])
    return component


def test_every_folder_maps_to_modules():
    modules = _modules()
    assert "tfscale.cluster" in modules and "tfscale.launch.launcher" in modules
    assert "tfscale.strategies.pipeline.schedules" in modules


def test_imports_run_one_way_without_cycles():
    assert sorted(_violations(_graph())) == [], "layer violations"


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"tfscale.cluster": {"tfscale.train"}, "tfscale.train": set()}, "up:"),
        ({"tfscale.compat.x": {"tfscale.cluster"}, "tfscale.cluster": set()}, "leaf"),
        ({"tfscale.a": {"tfscale.b"}, "tfscale.b": {"tfscale.a"}}, "cycle"),
        ({"tfscale.cluster_cli": {"tfscale.launch._remote"}, "tfscale.launch._remote": set()}, "private"),
    ],
)
def test_checker_names_the_bad_edge(graph, expected):
    assert any(expected in v for v in _violations(graph))


@pytest.mark.parametrize(
    "variable",
    [
        "TFSCALE_RESTART_COUNT",
        "TFSCALE_JOB_ID",
        "TFSCALE_ELASTIC_WORKERS",
        "TFSCALE_ELASTIC_BATCH",
        "TFSCALE_RESULT",
        "TF_CONFIG",
    ],
)
def test_each_launcher_task_variable_is_named_by_its_owner_alone(variable):
    # The launcher <-> task protocol (tfscale/_task_protocol.py) owns the variables' names.
    owner = ROOT / "tfscale" / "_task_protocol.py"
    naming = [
        path
        for path in _modules().values()
        if any(
            isinstance(node, ast.Constant) and node.value == variable
            for node in ast.walk(ast.parse(path.read_text()))
        )
    ]
    assert naming == [owner]


def test_the_training_binary_reads_the_task_protocol_without_importing_the_launcher():
    assert not {m for m in _graph()["tfscale.train"] if m.startswith("tfscale.launch")}


def _pictured():
    """{layer group id: the modules its boxes name} in the README's picture of the layers."""
    svg = ElementTree.parse(ROOT / "docs" / "img" / "layers.svg").getroot()
    return {
        group.get("id"): {t.get("data-module") for t in group.iter() if t.get("data-module")}
        for group in svg.iter("{http://www.w3.org/2000/svg}g")
    }


def test_the_picture_of_the_layers_shows_the_rule_checked_here():
    # README.md and docs/layout.md show docs/img/layers.svg: each box is in the layer this
    # test gives its module, and the top two layers are drawn whole.
    pictured, modules = _pictured(), _modules()
    assert sorted(pictured) == ["binaries", "capabilities", "core"]
    assert pictured["binaries"] == BINARIES
    assert pictured["capabilities"] == set(CAPABILITIES)
    core = ("errors", "cluster", "callbacks", "compat", "_strategy_spec", "_task_protocol", "_save_policy")
    assert pictured["core"] == {f"tfscale.{name}" for name in core}
    for name, layer in (("binaries", BINARY), ("capabilities", CAPABILITY), ("core", CORE)):
        for module in pictured[name]:
            assert module in modules and _layer(module) == layer, (module, name)
