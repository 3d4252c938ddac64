"""Read local data files (json, jsonl, csv, tsv, parquet) row by row with useful errors."""

from __future__ import annotations

import csv
import hashlib
import json
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

from calm_lightning.errors import DataFormatError

FORMATS = {".json": "json", ".jsonl": "jsonl", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet"}
HASH_CHARS = 16  # of the sha256's hex digest: enough to tell two files apart, short to read
_CHUNK = 1 << 20
_HASHES: dict[tuple[str, int, int], str] = {}


def content_hash(path: str | Path) -> str:
    """The first HASH_CHARS hex digits of the file's sha256, read in chunks; computed once per
    process for each (path, mtime, size), so a large file read by several splits costs one pass."""
    path = Path(path).resolve()
    stat = path.stat()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        _HASHES[key] = digest.hexdigest()[:HASH_CHARS]
    return _HASHES[key]


def describe_file(path: str | Path) -> dict:
    """A data file as a run records it: its name and content hash, never its directory (a path
    of one machine says nothing elsewhere; the hash says whether two runs read the same data)."""
    path = Path(path)
    return {"name": path.name, "sha256": content_hash(path) if path.is_file() else None}


def file_labels(paths: Sequence[str | Path]) -> list[str]:
    """How record ids name each file: its name, with `#<position>` added to a name that two of
    `paths` share (so ids stay unique without naming any directory)."""
    names = [Path(p).name for p in paths]
    shared = {n for n, count in Counter(names).items() if count > 1}
    return [f"{n}#{i}" if n in shared else n for i, n in enumerate(names, start=1)]


def read_rows(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yield (line number, row dict); line numbers are 1-based lines for text formats and
    1-based row indices for json arrays and parquet. Raises DataFormatError naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DataFormatError(f"data file not found: {path}")
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataFormatError(
            f"{path}: unsupported file type '{path.suffix}' (use one of {', '.join(FORMATS)})"
        )
    if path.stat().st_size == 0:
        raise DataFormatError(f"{path}: the file is empty")
    reader = {"json": _json, "jsonl": _jsonl, "csv": _csv, "tsv": _tsv, "parquet": _parquet}[kind]
    count = 0
    for line, row in reader(path):
        if not isinstance(row, dict):
            raise DataFormatError(
                f"{path}, line {line}: expected an object, got {type(row).__name__}"
            )
        count += 1
        yield line, row
    if count == 0:
        raise DataFormatError(f"{path}: the file holds no rows")


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8") as handle:
        for line_no, text in enumerate(handle, start=1):
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{path}, line {line_no}: invalid JSON ({err.msg})") from err


def _json(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise DataFormatError(f"{path}, line {err.lineno}: invalid JSON ({err.msg})") from err
    if isinstance(data, dict):
        # The column-oriented layout some exporters write: {"col": [..], ...}.
        if data and all(isinstance(v, list) for v in data.values()):
            lengths = {len(v) for v in data.values()}
            if len(lengths) != 1:
                raise DataFormatError(f"{path}: columns have different lengths {sorted(lengths)}")
            keys = list(data)
            data = [
                dict(zip(keys, values, strict=True)) for values in zip(*data.values(), strict=True)
            ]
        else:
            data = [data]
    if not isinstance(data, list):
        raise DataFormatError(f"{path}: expected a list of objects")
    yield from enumerate(data, start=1)


def _delimited(path: Path, delimiter: str) -> Iterator[tuple[int, dict]]:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, delimiter=delimiter)
        for row in reader:
            if None in row:
                raise DataFormatError(
                    f"{path}, line {reader.line_num}: more fields than the header has"
                )
            yield reader.line_num, {k: _maybe_json(v) for k, v in row.items()}


def _maybe_json(value: str | None):
    """CSV cells holding lists (e.g. choices) are written as JSON; decode those."""
    if value is None:
        return value
    text = value.strip()
    if text[:1] in "[{":
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            return value
    return value


def _csv(path: Path) -> Iterator[tuple[int, dict]]:
    return _delimited(path, ",")


def _tsv(path: Path) -> Iterator[tuple[int, dict]]:
    return _delimited(path, "\t")


def _parquet(path: Path) -> Iterator[tuple[int, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError as err:
        raise DataFormatError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow)"
        ) from err
    table = pq.read_table(path)
    yield from enumerate(table.to_pylist(), start=1)
