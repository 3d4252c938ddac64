"""Test modules share composed configs and override lists through conftest.py fixtures, never
by importing from each other or from conftest (a Hydra `_target_` string is no import)."""

from __future__ import annotations

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
