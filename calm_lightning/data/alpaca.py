"""Stanford Alpaca (tatsu-lab/alpaca: instruction, input, output), split as in the paper:
the first 48,002 rows train, the next 2,000 are held out, the last 2,000 are the test split."""

from __future__ import annotations

import logging
from collections import Counter

from calm_lightning.data.files import read_rows
from calm_lightning.data.hub import hub_rows
from calm_lightning.data.records import InstructionRecord
from calm_lightning.errors import ConfigError, DataFormatError

log = logging.getLogger(__name__)
SPLITS = ("train", "heldout", "test")
_ROWS_CACHE: dict[tuple, tuple[list[InstructionRecord], Counter]] = {}


def alpaca_record(row: dict, where: str, index: int) -> InstructionRecord | None:
    """A record, or None for a row without a response (nothing to train on)."""
    for name in ("instruction", "output"):
        if name not in row:
            raise DataFormatError(f"{where}: missing field '{name}' (got {sorted(row)})")
        if not isinstance(row[name], str):
            raise DataFormatError(f"{where}: field '{name}' is not text")
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise DataFormatError(f"{where}: field 'input' is not text")
    if not row["instruction"].strip() or not row["output"].strip():
        return None
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
        self.skipped: Counter = Counter()

    def _all_rows(self) -> list[InstructionRecord]:
        key = (self.hub_id, self.hub_split, tuple(self.files or ()))
        if key not in _ROWS_CACHE:
            records, skipped = [], Counter()
            if self.files:
                rows = ((f"{p}, line {n}", r) for p in self.files for n, r in read_rows(p))
            else:
                option = "setting.<split>.files"
                rows = (
                    (f"{self.hub_id}[{self.hub_split}], row {n}", r)
                    for n, r in hub_rows(self.hub_id, None, self.hub_split, option)
                )
            for index, (where, row) in enumerate(rows):
                record = alpaca_record(row, where, index)
                if record is None:
                    skipped["empty instruction or output"] += 1
                else:
                    records.append(record)
            _ROWS_CACHE[key] = (records, skipped)
        records, self.skipped = _ROWS_CACHE[key]
        return records

    def load(self) -> list[InstructionRecord]:
        rows = self._all_rows()
        train, heldout, test = (self.sizes[s] for s in SPLITS)
        if train + heldout + test > len(rows):
            raise DataFormatError(
                f"Alpaca has {len(rows)} usable rows but the splits ask for {train} + {heldout} + "
                f"{test}; lower setting.*.train_size / heldout_size / test_size"
            )
        chosen = {
            "train": rows[:train],
            "heldout": rows[train : train + heldout],
            "test": rows[len(rows) - test :],
        }[self.split]
        return chosen[: self.limit] if self.limit else chosen

    def describe(self) -> dict:
        origin = self.files or f"{self.hub_id}[{self.hub_split}]"
        return {
            "name": self.name,
            "kind": self.kind,
            "origin": origin,
            "sizes": self.sizes,
            "skipped": dict(self.skipped),
        }
