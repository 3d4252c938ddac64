"""The package's modules form a layered graph, read from the source: no import points upward
in the layer table of docs/architecture.md (every package and root module has its row, none is
exempt), and no import cycle.

Every `import` / `from ... import` statement counts, at module level and inside functions
alike: an import deferred into a function to dodge a cycle at import time is still a cycle in
the design (two modules that each need the other). Importing `a.b.c` also runs the packages
`a` and `a.b`, so those count as imported too. Only `importlib.import_module` with a computed
name (the package's lazy attributes in calm_lightning/__init__.py, the dispatcher's commands)
is not seen.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "calm_lightning"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


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


def unit_of(module: str) -> str:
    """The row a module is placed by: its top-level package (`runtime` for
    calm_lightning.runtime.job_state), its own name for a root module (`pipeline`), and
    `__init__` for the package itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def layer_table(text: str) -> dict[str, int]:
    """unit -> row from the table under `## Layers` of docs/architecture.md: each row's second
    cell names its units as `name/` (a package) or `name.py` (a root module)."""
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, int] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].isdigit():
            continue
        for name in re.findall(r"`(\w+)(?:\.py|/)`", cells[1]):
            assert name not in rows, f"{name} is on two rows of the layer table"
            rows[name] = int(cells[0])
    return rows


def upward_imports(graph: dict[str, set[str]], rows: dict[str, int]) -> list[tuple[str, str]]:
    """Every (module, imported) pair where the imported module's unit is on the module's own
    row or a higher one (a unit may import itself and the rows below it)."""
    return sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if unit_of(target) != unit_of(module) and rows[unit_of(target)] >= rows[unit_of(module)]
    )


def test_no_import_points_upward():
    """docs/architecture.md's layer table is the rule: a module imports its own package and
    the rows below it, never its own row's other units nor a row above."""
    rows = layer_table(ARCHITECTURE.read_text())
    graph = import_graph()
    units = {unit_of(module) for module in graph}
    assert units - set(rows) == set(), "give these a row of the layer table"
    assert set(rows) - units == set(), "the layer table names what is not in the package"
    upward = [
        f"{module} (row {rows[unit_of(module)]}) -> {target} (row {rows[unit_of(target)]})"
        for module, target in upward_imports(graph, rows)
    ]
    assert upward == []


def test_the_layer_check_flags_what_a_hand_drawn_graph_holds():
    rows = {"__init__": 1, "runtime": 2, "data": 3, "metrics": 3, "pipeline": 4}
    graph = {
        "calm_lightning": set(),
        "calm_lightning.runtime.record": {"calm_lightning", "calm_lightning.runtime"},
        "calm_lightning.runtime": set(),
        "calm_lightning.data.files": {"calm_lightning.runtime.record", "calm_lightning.metrics"},
        "calm_lightning.metrics": set(),
        "calm_lightning.pipeline": {"calm_lightning.data.files", "calm_lightning.runtime"},
    }
    # the same row is refused too: data and metrics are side by side, neither under the other
    assert upward_imports(graph, rows) == [("calm_lightning.data.files", "calm_lightning.metrics")]
    graph["calm_lightning.runtime.record"].add("calm_lightning.pipeline")
    assert ("calm_lightning.runtime.record", "calm_lightning.pipeline") in upward_imports(
        graph, rows
    )


def test_an_upward_import_in_the_real_package_would_be_caught():
    rows = layer_table(ARCHITECTURE.read_text())
    graph = import_graph()
    graph["calm_lightning.runtime.run_record"] = {"calm_lightning.pipeline"}
    graph["calm_lightning.data.records"] = {"calm_lightning.methods.base", "calm_lightning.errors"}
    assert upward_imports(graph, rows) == [
        ("calm_lightning.data.records", "calm_lightning.methods.base"),
        ("calm_lightning.runtime.run_record", "calm_lightning.pipeline"),
    ]


def test_the_layer_table_is_read_from_its_section_only():
    text = (
        "# Doc\n\n| 1 | `ignored.py` |\n\n## Layers\n\n| row | units | what |\n|---|---|---|\n"
        "| 1 | `__init__.py`, `errors.py` | the bottom |\n| 2 | `runtime/` (and prose) | |\n"
        "\n## Next\n\n| 3 | `after.py` | |\n"
    )
    assert layer_table(text) == {"__init__": 1, "errors": 1, "runtime": 2}


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
        "    import calm_lightning.validation\n"
    )
    path = tmp_path / "module.py"
    path.write_text(source)
    found = imported_names(path, "calm_lightning.models.module")
    assert "calm_lightning.models.sibling" in found
    assert "calm_lightning.other.thing" in found
    assert "calm_lightning.validation" in found


def test_the_rule_primitives_and_the_multirun_flag_import_nothing_of_the_project():
    """Any module may use them, so they may use nothing that could import that module."""
    graph = import_graph()
    assert graph["calm_lightning.config_rules"] <= {"calm_lightning", "calm_lightning.errors"}
    assert graph["calm_lightning.runtime.multirun"] <= {"calm_lightning", "calm_lightning.runtime"}


def test_the_files_an_export_copies_import_only_each_other():
    """The head's module, the logits processor and the custom modeling code run in an exported
    folder without this project (exported/writer.py's `portable_source`)."""
    graph = import_graph()
    head = "calm_lightning.models.logit_adjustment"
    assert graph[head] <= {"calm_lightning", "calm_lightning.models"}
    packages = {"calm_lightning", "calm_lightning.models", "calm_lightning.exported"}
    for module in ("models.logits_processor", "exported.hub_modeling"):
        assert graph[f"calm_lightning.{module}"] <= packages | {head}
