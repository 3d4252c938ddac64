"""Stanford Alpaca (tatsu-lab/alpaca: instruction, input, output), split as in the paper by raw
row index: the first 48,002 rows train, the next 2,000 are held out, the last 2,000 are the test
split. Rows without a response (28 of the hub's 52,002 have an empty output) are dropped inside
their block and counted, so the blocks never shift."""

from __future__ import annotations

import logging
from collections import Counter

from calm_lightning.data.files import describe_file, file_labels, read_rows
from calm_lightning.data.hub import hub_rows
from calm_lightning.data.records import InstructionRecord
from calm_lightning.errors import ConfigError, DataFormatError, DataSizeError

log = logging.getLogger(__name__)
SPLITS = ("train", "heldout", "test")
_ROWS_CACHE: dict[tuple, list[InstructionRecord | str]] = {}


def alpaca_record(row: dict, where: str, index: int) -> InstructionRecord | str:
    """A record with id `alpaca-<raw index>`, or the reason a row without a response (nothing to
    train on) is dropped."""
    for name in ("instruction", "output"):
        if name not in row:
            raise DataFormatError(f"{where}: missing field '{name}' (got {sorted(row)})")
        if not isinstance(row[name], str):
            raise DataFormatError(f"{where}: field '{name}' is not text")
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise DataFormatError(f"{where}: field 'input' is not text")
    for name in ("output", "instruction"):
        if not row[name].strip():
            return f"empty {name}"
    return InstructionRecord(row["instruction"], extra, row["output"], id=f"alpaca-{index}")


class AlpacaSource:
    """One split of Alpaca, from the Hub (or cache) or from local files in its schema."""

    kind = "instruction"

    def __init__(
        self,
        split: str,
        hub_id: str = "tatsu-lab/alpaca",
        hub_split: str = "train",
        files=None,
        train_size: int = 48002,
        heldout_size: int = 2000,
        test_size: int = 2000,
        limit: int | None = None,
    ) -> None:
        if split not in SPLITS:
            raise ConfigError(f"Alpaca split {split!r} is not one of {', '.join(SPLITS)}")
        self.split = split
        self.hub_id, self.hub_split = hub_id, hub_split
        self.files = [files] if isinstance(files, str) else (list(files) if files else None)
        self.sizes = {
            "train": int(train_size),
            "heldout": int(heldout_size),
            "test": int(test_size),
        }
        self.limit = limit
        self.name = f"alpaca_{split}"
        self.raw_rows: int | None = None
        self.blocks: dict[str, dict] = {}
        self.skipped: Counter = Counter()

    @property
    def origin(self) -> str:
        """The data as an error names it: the hub id and split, or the files' names."""
        if self.files:
            return ", ".join(file_labels(self.files))
        return f"{self.hub_id}[{self.hub_split}]"

    def _raw_rows(self) -> list[InstructionRecord | str]:
        """Every raw row in order: its record, or the reason it is dropped."""
        key = (self.hub_id, self.hub_split, tuple(self.files or ()))
        if key not in _ROWS_CACHE:
            if self.files:
                rows = ((f"{p}, line {n}", r) for p in self.files for n, r in read_rows(p))
            else:
                option = "setting.<split>.files"
                rows = (
                    (f"{self.hub_id}[{self.hub_split}], row {n}", r)
                    for n, r in hub_rows(self.hub_id, None, self.hub_split, option)
                )
            _ROWS_CACHE[key] = [alpaca_record(row, where, i) for i, (where, row) in enumerate(rows)]
        return _ROWS_CACHE[key]

    def ranges(self, n_rows: int) -> dict[str, tuple[int, int]]:
        """Each split's [start, stop) over the raw rows; a block that does not fit (the blocks
        would overlap, or run past the data) raises DataSizeError naming the split."""
        train, heldout, test = (self.sizes[s] for s in SPLITS)
        ranges = {
            "train": (0, train),
            "heldout": (train, train + heldout),
            "test": (n_rows - test, n_rows),
        }
        room = {"train": n_rows, "heldout": n_rows - train, "test": n_rows - train - heldout}
        for split in SPLITS:
            if self.sizes[split] > room[split]:
                available = max(room[split], 0)
                raise DataSizeError(
                    f"Alpaca split '{split}' does not fit: {self.origin} has {n_rows} raw rows, "
                    f"{available} left for {split} but {self.sizes[split]} asked (the splits "
                    f"ask for {train} train + {heldout} heldout + {test} test = "
                    f"{train + heldout + test} raw rows); lower {split}_size (setting.train."
                    f"{split}_size under setting=ood) or give the full data",
                    split=split,
                    source=self.origin,
                    available=available,
                    asked=self.sizes[split],
                )
        return ranges

    def load(self) -> list[InstructionRecord]:
        rows = self._raw_rows()
        self.raw_rows = len(rows)
        self.blocks = {}
        for split, (start, stop) in self.ranges(len(rows)).items():
            block = rows[start:stop]
            skipped = Counter(r for r in block if isinstance(r, str))
            self.blocks[split] = {
                "raw_rows": [start, stop],
                "kept": len(block) - sum(skipped.values()),
                "dropped": dict(skipped),
            }
        start, stop = self.blocks[self.split]["raw_rows"]
        chosen = [r for r in rows[start:stop] if not isinstance(r, str)]
        self.skipped = Counter(self.blocks[self.split]["dropped"])
        if self.skipped:
            log.info(
                "Alpaca %s: dropped %s of raw rows %d..%d",
                self.split,
                dict(self.skipped),
                start,
                stop - 1,
            )
        return chosen[: self.limit] if self.limit else chosen

    def describe(self) -> dict:
        """The source for data_summary.json: sizes in raw rows, each block's raw row range, rows
        kept and dropped (by reason), and this split's drops under `skipped` (the only key of
        that name, so a reader summing `skipped` counts each row once)."""
        origin = [describe_file(f) for f in self.files] if self.files else self.origin
        return {
            "name": self.name,
            "kind": self.kind,
            "origin": origin,
            "sizes": self.sizes,
            "raw_rows": self.raw_rows,
            "blocks": self.blocks,
            "skipped": dict(self.skipped),
        }
