"""The package's layer order, written down once: imports only go down.

Each row is a layer, lowest first; the packages (or top-level modules) of a row are siblings
that do not import each other. A module may import its own package and any package of a lower
row, at module level or inside a function alike (mcore_rl/__init__.py, the public face, may
re-export from any layer). The test reads the sources (nothing is
imported), so it fails on the line that breaks the order, and on any import cycle between
modules.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

LAYERS = (
    ("config",),
    ("runtime",),
    ("sandbox",),
    ("param_layout", "algorithms", "data", "rewards", "evaluation", "observability"),
    ("checkpoint",),
    ("conversion",),
    ("models",),
    ("training",),
    ("resharding",),
    ("rollout",),
    ("agents",),
    ("roles",),
    ("rl", "sft", "preference", "smoke", "serve"),
    ("cli", "quickstart", "launch_check"),
    ("__main__",),
)
"""Lowest first. Every package and top-level module of mcore_rl appears exactly once."""

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "mcore_rl"


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(absolute mcore_rl module, line) of every import in the file, lazy ones included."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.append((base, node.lineno))
            # `from package import module` names a module too
            found += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return [(target, line) for target, line in found
            if target == "mcore_rl" or target.startswith("mcore_rl.")]


def _unit(module: str) -> str:
    """The layered unit a module belongs to: its top-level package or module under mcore_rl."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


SOURCES = sorted(PACKAGE.rglob("*.py"))
MODULES = {_module_name(path) for path in SOURCES}
LEVEL = {unit: level for level, row in enumerate(LAYERS) for unit in row}


def test_every_package_has_a_layer():
    units = {_unit(module) for module in MODULES} - {""}
    assert sorted(units - set(LEVEL)) == [], "add these to LAYERS"
    assert sorted(set(LEVEL) - units) == [], "LAYERS names what no longer exists"
    assert sum(map(len, LAYERS)) == len(LEVEL), "a unit appears in two rows"


def test_imports_only_go_down():
    upward = []
    for path in SOURCES:
        source = _unit(_module_name(path))
        if source == "":
            continue  # mcore_rl/__init__.py: the public face, re-exporting from the top
        for target, line in _imports(path):
            if target not in MODULES and target.rpartition(".")[0] in MODULES:
                continue  # `from package import name`: the name is not a module
            unit = _unit(target)
            if unit in ("", source):
                continue
            if LEVEL[unit] >= LEVEL[source]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {source} "
                              f"(layer {LEVEL[source]}) imports {target} (layer {LEVEL[unit]})")
    assert upward == []


def test_no_import_cycle_between_modules():
    graph = {module: set() for module in MODULES}
    for path in SOURCES:
        source = _module_name(path)
        for target, _ in _imports(path):
            if target in MODULES and target != source and not source.startswith(target + "."):
                graph[source].add(target)
    state, stack = {}, []

    def visit(module):
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycle = stack[stack.index(target):] + [target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
