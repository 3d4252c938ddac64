"""The MCQA benchmark of the paper: MMLU, MedMCQA, OpenBookQA and ARC-Challenge normalised to
one record type, pooled, and carved into ID train / calibration / test and an OOD test split by
deterministic seeded sampling.

Each source is read from the Hub (or its cache) through `datasets`, or from local files in the
hub dataset's own schema; both paths meet in the same per-source normaliser.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from calm_lightning.data.files import read_rows
from calm_lightning.data.hub import hub_rows
from calm_lightning.data.records import N_OPTIONS, MCQARecord
from calm_lightning.errors import ConfigError, DataFormatError

log = logging.getLogger(__name__)

SPLITS = ("train", "calibration", "test", "ood_test")
LETTERS = "ABCDEFGHIJ"


class Skip(Exception):
    """A row the paper's procedure drops (counted, not an error)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _text(row: dict, name: str, where: str) -> str:
    if name not in row:
        raise DataFormatError(f"{where}: missing field '{name}' (got {sorted(row)})")
    value = row[name]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(f"{where}: field '{name}' is empty or not text")
    return value.strip()


def _int(value, name: str, where: str) -> int:
    if isinstance(value, bool):
        raise DataFormatError(f"{where}: field '{name}' must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise DataFormatError(f"{where}: field '{name}' must be an integer, got {value!r}")


def _options(choices: list, where: str) -> list[str]:
    if len(choices) != N_OPTIONS:
        raise Skip(f"{len(choices)} options")
    out = [str(c).strip() for c in choices]
    if any(not c for c in out):
        raise Skip("empty option")
    return out


def _labelled_choices(row: dict, question_field: str, where: str) -> tuple[str, list[str], int]:
    """OpenBookQA / ARC: `choices = {text: [...], label: [...]}` and a letter or digit key."""
    question = _text(row, question_field, where)
    choices = row.get("choices")
    if not isinstance(choices, Mapping) or "text" not in choices or "label" not in choices:
        raise DataFormatError(f"{where}: field 'choices' must hold 'text' and 'label' lists")
    texts, labels = list(choices["text"]), [str(x).strip() for x in choices["label"]]
    if len(texts) != len(labels):
        raise DataFormatError(f"{where}: 'choices.text' and 'choices.label' differ in length")
    options = _options(texts, where)
    key = str(row.get("answerKey", "")).strip()
    if not key:
        raise DataFormatError(f"{where}: missing field 'answerKey'")
    if key not in labels:
        raise DataFormatError(f"{where}: answerKey {key!r} is not one of the labels {labels}")
    return question, options, labels.index(key)


def normalise_mmlu(row: dict, where: str) -> dict:
    question = _text(row, "question", where)
    if "choices" not in row:
        raise DataFormatError(f"{where}: missing field 'choices'")
    options = _options(list(row["choices"]), where)
    if "answer" not in row:
        raise DataFormatError(f"{where}: missing field 'answer'")
    answer = _int(row["answer"], "answer", where)
    return {
        "question": question,
        "choices": options,
        "answer": answer,
        "subject": str(row.get("subject", "")),
    }


def normalise_medmcqa(row: dict, where: str) -> dict:
    question = _text(row, "question", where)
    for name in ("opa", "opb", "opc", "opd", "cop"):
        if name not in row:
            raise DataFormatError(f"{where}: missing field '{name}'")
    options = _options([row["opa"], row["opb"], row["opc"], row["opd"]], where)
    answer = _int(row["cop"], "cop", where)
    if answer < 0:
        raise Skip("unlabelled (cop = -1, the hub's test split)")
    return {
        "question": question,
        "choices": options,
        "answer": answer,
        "subject": str(row.get("subject_name") or ""),
    }


def normalise_openbookqa(row: dict, where: str) -> dict:
    question, options, answer = _labelled_choices(row, "question_stem", where)
    return {"question": question, "choices": options, "answer": answer, "subject": "science"}


def normalise_arc(row: dict, where: str) -> dict:
    # ARC labels are letters for most items and digits ("1".."4") for some; the answer key uses
    # the same labels, so its position among the labels is the answer index either way.
    question, options, answer = _labelled_choices(row, "question", where)
    return {"question": question, "choices": options, "answer": answer, "subject": "science"}


NORMALISERS: dict[str, Callable[[dict, str], dict]] = {
    "mmlu": normalise_mmlu,
    "medmcqa": normalise_medmcqa,
    "openbookqa": normalise_openbookqa,
    "arc_challenge": normalise_arc,
}


@dataclass
class SourceSpec:
    """Where one MCQA source comes from."""

    name: str
    hub_id: str
    config: str | None = None
    splits: list[str] = field(default_factory=list)
    files: list[str] | None = None


@dataclass
class SourceStats:
    rows: int = 0
    kept: int = 0
    duplicates: int = 0
    skipped: Counter = field(default_factory=Counter)


def read_source(spec: SourceSpec) -> tuple[list[MCQARecord], SourceStats]:
    """All usable records of one source, normalised; skips counted by reason."""
    if spec.name not in NORMALISERS:
        raise ConfigError(f"unknown MCQA source {spec.name!r} (known: {', '.join(NORMALISERS)})")
    normalise = NORMALISERS[spec.name]
    stats = SourceStats()
    records: list[MCQARecord] = []
    seen: set[str] = set()
    for origin, line, row in _rows(spec):
        stats.rows += 1
        where = f"{origin}, row {line}"
        try:
            item = normalise(row, where)
        except Skip as skip:
            stats.skipped[skip.reason] += 1
            continue
        if not 0 <= item["answer"] < N_OPTIONS:
            raise DataFormatError(f"{where}: answer {item['answer']} is outside 0..3")
        key = " ".join(item["question"].lower().split()) + "||" + "|".join(item["choices"])
        if key in seen:
            stats.duplicates += 1
            continue
        seen.add(key)
        source_id = row.get("id") or row.get("question_id")
        records.append(
            MCQARecord(
                id=f"{spec.name}-{source_id if source_id else f'{origin}-{line}'}",
                question=item["question"],
                choices=tuple(item["choices"]),
                answer=item["answer"],
                source=spec.name,
                subject=item["subject"],
            )
        )
    stats.kept = len(records)
    return records, stats


def _rows(spec: SourceSpec) -> Iterable[tuple[str, int, dict]]:
    if spec.files:
        for path in spec.files:
            for line, row in read_rows(path):
                yield str(path), line, row
        return
    for split in spec.splits:
        option = f"setting.<split>.sources.{spec.name}.files"
        for line, row in hub_rows(spec.hub_id, spec.config, split, option):
            yield f"{spec.hub_id}[{split}]", line, row


def carve_splits(
    pools: Mapping[str, list[MCQARecord]], sizes: Mapping[str, int], seed: int
) -> dict[str, list[MCQARecord]]:
    """Disjoint splits drawn round-robin over the shuffled sources, in SPLITS order.

    Each source is shuffled with its own seeded generator, the sources are interleaved one
    record at a time (so every split mixes all sources evenly while they last), and the
    splits take consecutive blocks of that order. Same pools + sizes + seed = same splits.
    """
    shuffled = []
    for name in sorted(pools):
        records = list(pools[name])
        random.Random(f"{seed}-{name}").shuffle(records)
        shuffled.append(records)
    order = [r for group in _interleave(shuffled) for r in group]
    out, start = {}, 0
    for split in SPLITS:
        size = int(sizes.get(split, 0))
        out[split] = order[start : start + size]
        if len(out[split]) < size:
            log.warning("MCQA %s split: only %d of %d records left", split, len(out[split]), size)
        start += size
    return out


def _interleave(lists: list[list]) -> Iterable[list]:
    longest = max((len(x) for x in lists), default=0)
    for i in range(longest):
        yield [x[i] for x in lists if i < len(x)]


_POOL_CACHE: dict[tuple, tuple[dict, dict]] = {}


class MCQASource:
    """One split of the pooled MCQA benchmark (the record type every evaluation reads)."""

    kind = "mcqa"

    def __init__(
        self,
        split: str,
        sources: Mapping[str, Mapping],
        sizes: Mapping[str, int],
        seed: int = 0,
        limit: int | None = None,
        name: str = "mcqa",
    ) -> None:
        if split not in SPLITS:
            raise ConfigError(f"MCQA split {split!r} is not one of {', '.join(SPLITS)}")
        if not sources:
            raise ConfigError("the MCQA data needs at least one source")
        self.split = split
        self.specs = [
            SourceSpec(
                name=n,
                hub_id=s["hub_id"],
                config=s.get("config"),
                splits=list(s.get("splits") or []),
                files=_files(s.get("files")),
            )
            for n, s in sources.items()
        ]
        self.sizes = {k: int(v) for k, v in sizes.items()}
        self.seed = int(seed)
        self.limit = limit
        self.name = f"{name}_{split}"
        self.stats: dict[str, SourceStats] = {}

    def _key(self) -> tuple:
        specs = tuple(
            (s.name, s.hub_id, s.config, tuple(s.splits), tuple(s.files or ())) for s in self.specs
        )
        return specs, tuple(sorted(self.sizes.items())), self.seed

    def load(self) -> list[MCQARecord]:
        key = self._key()
        if key not in _POOL_CACHE:
            pools, stats = {}, {}
            for spec in self.specs:
                pools[spec.name], stats[spec.name] = read_source(spec)
                s = stats[spec.name]
                log.info(
                    "MCQA source %s: %d rows, %d kept, %d duplicates, skipped %s",
                    spec.name,
                    s.rows,
                    s.kept,
                    s.duplicates,
                    dict(s.skipped),
                )
            _POOL_CACHE[key] = (carve_splits(pools, self.sizes, self.seed), stats)
        splits, self.stats = _POOL_CACHE[key]
        records = splits[self.split]
        return records[: self.limit] if self.limit else records

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "sources": {
                s.name: (s.files or f"{s.hub_id}:{s.config or '-'}:{'+'.join(s.splits)}")
                for s in self.specs
            },
            "sizes": self.sizes,
            "seed": self.seed,
            "per_source": {
                name: {
                    "rows": st.rows,
                    "kept": st.kept,
                    "duplicates": st.duplicates,
                    "skipped": dict(st.skipped),
                }
                for name, st in self.stats.items()
            },
        }


def _files(value) -> list[str] | None:
    if value in (None, "", []):
        return None
    return [value] if isinstance(value, str) else [str(v) for v in value]
