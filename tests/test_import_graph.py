"""No import cycle in the package: its modules form a layered graph, read from the source.

Every `import` / `from ... import` statement counts, at module level and inside functions
alike: an import deferred into a function to dodge a cycle at import time is still a cycle in
the design (two modules that each need the other). Importing `a.b.c` also runs the packages
`a` and `a.b`, so those count as imported too. Only `importlib.import_module` with a computed
name (the package's lazy attributes in calm_lightning/__init__.py) is not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "calm_lightning"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, name: str) -> set[str]:
    """The dotted names a module's import statements bring in (relative ones made absolute)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a.b import c` imports a.b, and a.b.c when c is a module
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return found


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package that importing it runs."""
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for imported in imported_names(path, name):
            parts = imported.split(".")
            # the module itself and every package above it
            edges |= {".".join(parts[:i]) for i in range(1, len(parts) + 1)}
        graph[name] = {m for m in edges if m in paths and m != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search, white / grey / black)."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                return [*stack[stack.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_package_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "calm_lightning.pipeline" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b", "c"}, "b": set(), "c": {"c2"}, "c2": {"c"}}, ["c", "c2", "c"]),
    ],
)
def test_the_cycle_search_finds_what_a_hand_drawn_graph_holds(graph, expected):
    assert find_cycle(graph) == expected


def test_function_level_and_relative_imports_are_read(tmp_path):
    source = (
        "from . import sibling\n"
        "from ..other import thing\n"
        "def later():\n"
        "    import calm_lightning.runtime.validation\n"
    )
    path = tmp_path / "module.py"
    path.write_text(source)
    found = imported_names(path, "calm_lightning.models.module")
    assert "calm_lightning.models.sibling" in found
    assert "calm_lightning.other.thing" in found
    assert "calm_lightning.runtime.validation" in found


def test_the_rule_primitives_and_the_multirun_flag_import_nothing_of_the_project():
    """Any module may use them, so they may use nothing that could import that module."""
    graph = import_graph()
    assert graph["calm_lightning.config_rules"] <= {"calm_lightning", "calm_lightning.errors"}
    assert graph["calm_lightning.runtime.multirun"] <= {"calm_lightning", "calm_lightning.runtime"}
