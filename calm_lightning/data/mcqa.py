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

from calm_lightning.data.files import describe_file, file_labels, read_rows
from calm_lightning.data.hub import hub_rows
from calm_lightning.data.records import N_OPTIONS, MCQARecord
from calm_lightning.errors import ConfigError, DataFormatError, DataSizeError

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

    @property
    def origin(self) -> str:
        """Where the rows come from, as messages name it: the files' names, or the hub's."""
        if self.files:
            return ", ".join(file_labels(self.files))
        return f"{self.hub_id}:{self.config or '-'}:{'+'.join(self.splits)}"


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
    for origin, label, line, row in _rows(spec):
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
                id=f"{spec.name}-{source_id if source_id else f'{label}-{line}'}",
                question=item["question"],
                choices=tuple(item["choices"]),
                answer=item["answer"],
                source=spec.name,
                subject=item["subject"],
            )
        )
    stats.kept = len(records)
    return records, stats


def _rows(spec: SourceSpec) -> Iterable[tuple[str, str, int, dict]]:
    """(where errors point, how an id-less row's id names its origin, line, row): a file's
    path for errors, its name for ids (ids must not change when the data moves)."""
    if spec.files:
        for path, label in zip(spec.files, file_labels(spec.files), strict=True):
            for line, row in read_rows(path):
                yield str(path), label, line, row
        return
    for split in spec.splits:
        option = f"setting.<split>.sources.{spec.name}.files"
        for line, row in hub_rows(spec.hub_id, spec.config, split, option):
            yield f"{spec.hub_id}[{split}]", f"{spec.hub_id}[{split}]", line, row


def carve_splits(
    pools: Mapping[str, list[MCQARecord]], sizes: Mapping[str, int], seed: int
) -> dict[str, list[MCQARecord]]:
    """Disjoint splits drawn round-robin over the shuffled sources, in SPLITS order.

    Each source is shuffled with its own seeded generator, the sources are interleaved one
    record at a time (so every split mixes all sources evenly while they last), and the
    splits take consecutive blocks of that order. Same pools + sizes + seed = same splits.
    A block the pool cannot fill comes out short (MCQASource.load says so).
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
        allow_fewer: bool = False,
    ) -> None:
        """`allow_fewer`: a split may hold fewer questions than its size (a pool that takes what
        its source has); otherwise a short split raises DataSizeError."""
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
        self.allow_fewer = bool(allow_fewer)
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
        asked = self.sizes.get(self.split, 0)
        asked = min(asked, int(self.limit)) if self.limit else asked
        if len(records) < asked:
            self._short(len(records), asked)
        return records[: self.limit] if self.limit else records

    def _short(self, available: int, asked: int) -> None:
        """A split the pool cannot fill: an error naming the split, the sources, the rows
        available and asked, and each source's drops (or a log line under allow_fewer)."""
        if self.allow_fewer:
            log.info("MCQA %s split: %d of at most %d questions", self.split, available, asked)
            return
        before = SPLITS[: SPLITS.index(self.split)]
        taken = " + ".join(f"{self.sizes.get(s, 0)} {s}" for s in before)
        pool = sum(st.kept for st in self.stats.values())
        per_source = "; ".join(
            f"{spec.name} ({spec.origin}): {st.rows} rows, {st.kept} kept"
            + (f", {st.duplicates} duplicates" if st.duplicates else "")
            + (f", dropped {dict(st.skipped)}" if st.skipped else "")
            for spec, st in ((spec, self.stats[spec.name]) for spec in self.specs)
        )
        sources = ", ".join(f"{spec.name} ({spec.origin})" for spec in self.specs)
        raise DataSizeError(
            f"MCQA split '{self.split}' asks for {asked} questions but {available} are "
            f"available: the pool holds {pool} usable questions"
            + (f", of which {taken} come first" if taken else "")
            + f". Sources: {per_source}. Lower sizes.{self.split} (setting.test.sizes.* under "
            "setting=ood, setting.train.sizes.* under setting=id) or give more data.",
            split=self.split,
            source=sources,
            available=available,
            asked=asked,
        )

    def describe(self) -> dict:
        """The source for data_summary.json: files by name and content hash (hub data by id),
        the sizes asked, and each source's rows, kept, duplicates and drops by reason."""
        return {
            "name": self.name,
            "kind": self.kind,
            "sources": {
                s.name: [describe_file(f) for f in s.files] if s.files else s.origin
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
