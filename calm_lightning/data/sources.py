"""Data sources: where records come from (the bundled demo files, local files). Each source
yields records of one kind, `mcqa`, `instruction` or `openqa`, through the same validation
code."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from calm_lightning.data.files import describe_file, file_labels, read_rows
from calm_lightning.data.records import (
    InstructionRecord,
    MCQARecord,
    OpenQARecord,
    instruction_from_row,
    mcqa_from_row,
    openqa_from_row,
)
from calm_lightning.errors import ConfigError

KINDS = ("mcqa", "instruction", "openqa")
PARSERS = {"mcqa": mcqa_from_row, "instruction": instruction_from_row, "openqa": openqa_from_row}
DEMO_DIR = Path(__file__).parent / "demo"
DEMO_SPLITS = ("train", "heldout", "test")
_DEMO_PREFIX = {"mcqa": "mcqa", "instruction": "instructions", "openqa": "openqa"}
Record = MCQARecord | InstructionRecord | OpenQARecord


def load_records(kind: str, files: Sequence[str | Path]) -> list[Record]:
    """Read and validate every row of `files` as records of `kind`."""
    if kind not in KINDS:
        raise ConfigError(f"data kind {kind!r} is not one of {', '.join(KINDS)}")
    parse = PARSERS[kind]
    records = []
    for path, label in zip(files, file_labels(files), strict=True):
        records.extend(parse(row, str(path), line, name=label) for line, row in read_rows(path))
    return records


class LocalFileSource:
    """Records of one kind from local json / jsonl / csv / tsv / parquet files."""

    def __init__(
        self, kind: str, files: str | Sequence[str], name: str = "local", limit: int | None = None
    ) -> None:
        self.kind = kind
        self.files = [files] if isinstance(files, str) else list(files)
        if not self.files:
            raise ConfigError(f"data source {name!r}: no files given")
        self.name = name
        self.limit = limit

    def load(self) -> list[Record]:
        records = load_records(self.kind, self.files)
        return records[: self.limit] if self.limit else records

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "files": [describe_file(f) for f in self.files],
        }


class EmbeddedDemoSource(LocalFileSource):
    """The project's own offline demo data (written by `python -m tools.demo_data.build`)."""

    def __init__(self, kind: str, split: str, limit: int | None = None) -> None:
        if kind not in KINDS:
            raise ConfigError(f"data kind {kind!r} is not one of {', '.join(KINDS)}")
        if split not in DEMO_SPLITS:
            raise ConfigError(f"demo split {split!r} is not one of {', '.join(DEMO_SPLITS)}")
        path = DEMO_DIR / f"{_DEMO_PREFIX[kind]}_{split}.jsonl"
        super().__init__(kind, [str(path)], name=f"demo_{kind}_{split}", limit=limit)
        self.split = split
