"""Test modules share composed configs and override lists through conftest.py fixtures, never
by importing from each other or from conftest (a Hydra `_target_` string is no import); the
package's files and functions stay short enough to read, and docs/architecture.md lists every
one of its files."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
IMPORT_FROM_TESTS = re.compile(r"\b(?:from|import) tests\.")


def test_no_test_file_imports_from_the_tests_package():
    offenders = []
    for path in sorted(TESTS.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts:
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if IMPORT_FROM_TESTS.search(line):
                offenders.append(f"{path.relative_to(TESTS)}:{number}: {line.strip()}")
    assert not offenders, "use a conftest.py fixture instead:\n" + "\n".join(offenders)


PACKAGE = TESTS.parent / "calm_lightning"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80  # decorators and docstring included


def _oversized(path: Path) -> list[str]:
    """The file itself when it is over MAX_FILE_LINES, and each function over
    MAX_FUNCTION_LINES."""
    text = path.read_text()
    found = []
    if len(text.splitlines()) > MAX_FILE_LINES:
        found.append(f"{path.name}: {len(text.splitlines())} lines")
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if node.end_lineno - start + 1 > MAX_FUNCTION_LINES:
                found.append(f"{path.name}:{node.lineno} {node.name}")
    return found


def test_every_package_file_and_function_stays_short():
    """A file over 500 lines or a function over 80 does several jobs: split it by what each
    part does."""
    found = [item for path in sorted(PACKAGE.rglob("*.py")) for item in _oversized(path)]
    assert not found, found


def test_the_size_rule_on_hand_made_modules(tmp_path):
    def body(n: int, indent: str = "    ") -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(n))

    cases = {
        "short.py": (f"def f():\n{body(79)}", []),  # 80 lines with the def
        "decorated.py": (f"@staticmethod\ndef g():\n{body(79)}", ["decorated.py:2 g"]),
        "nested.py": (f"class C:\n    def h(self):\n{body(80, ' ' * 8)}", ["nested.py:2 h"]),
        "long.py": ("x = 0\n" * (MAX_FILE_LINES + 1), [f"long.py: {MAX_FILE_LINES + 1} lines"]),
    }
    for name, (source, expected) in cases.items():
        (tmp_path / name).write_text(source)
        assert _oversized(tmp_path / name) == expected, name


ARCHITECTURE = TESTS.parent / "docs" / "architecture.md"
PY_NAME = re.compile(r"(?<![\w/.])(\w+\.py)\b")  # a bare file name, not a path into another folder


def listed_modules(text: str) -> set[str]:
    """The package's files as the `calm_lightning/` tree of docs/architecture.md's "Where things
    live" lists them: a root module is an entry of its own (`  run.py`), a package's files are
    the bare file names its entry (`  runtime/` and its indented lines) mentions."""
    block = text.split("\n## Where things live\n", 1)[1].split("```", 2)[1]
    lines = block.split("\ncalm_lightning/\n", 1)[1].splitlines()
    listed, package = set(), None
    for line in lines:
        if not line.startswith(" "):
            break  # the next top-level entry: the package's tree is over
        if not line.startswith("   "):  # an entry: two spaces, then its name
            name, _, line = line.strip().partition(" ")
            package = name.rstrip("/") if name.endswith("/") else None
            if package is None:
                listed.add(name)
        if package is not None:
            listed |= {f"{package}/{found}" for found in PY_NAME.findall(line)}
    return listed


def test_the_architecture_doc_lists_every_module():
    """Every file of the package (a subpackage's __init__.py aside) is listed in
    docs/architecture.md, and every file listed there exists."""
    on_disk = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent == PACKAGE
    }
    listed = listed_modules(ARCHITECTURE.read_text())
    assert on_disk - listed == set(), "list these in docs/architecture.md, Where things live"
    assert listed - on_disk == set(), "docs/architecture.md lists files that do not exist"


def test_the_module_list_is_read_from_the_package_tree():
    text = (
        "# Doc\n\n## Where things live\n\n```\ndocs/      notes.py is not ours\ncalm_lightning/\n"
        "  run.py        the command (also cli.py)\n  data/         records.py,\n"
        "                models/x.py (elsewhere), files.py\n  pipeline.py   the run\n"
        "tests/     test_x.py\n```\n"
    )
    assert listed_modules(text) == {"run.py", "data/records.py", "data/files.py", "pipeline.py"}
