"""Open-ended QA: PopQA (akariasai/PopQA) and TriviaQA (mandarjoshi/trivia_qa, rc.nocontext),
normalised to question + gold aliases and split into train / held-out / eval by seeded
shuffling (eval: 300 questions by default, as in the paper)."""

from __future__ import annotations

import json
import logging
import random
from collections import Counter

from calm_lightning.data.files import describe_file, file_labels, read_rows
from calm_lightning.data.hub import hub_rows
from calm_lightning.data.records import OpenQARecord, required_text
from calm_lightning.errors import ConfigError, DataFormatError, DataSizeError

log = logging.getLogger(__name__)
SPLITS = ("train", "heldout", "eval")


def _question(row: dict, where: str) -> str:
    return required_text(row, "question", where).strip()


def normalise_popqa(row: dict, where: str) -> tuple[str, list[str], str]:
    question = _question(row, where)
    if "possible_answers" not in row:
        raise DataFormatError(f"{where}: missing field 'possible_answers'")
    answers = row["possible_answers"]
    if isinstance(answers, str):  # the hub stores a JSON-encoded list
        try:
            answers = json.loads(answers)
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"{where}: field 'possible_answers' is not a JSON list ({err.msg})"
            ) from err
    if not isinstance(answers, list):
        raise DataFormatError(f"{where}: field 'possible_answers' must be a list")
    return question, [str(a) for a in answers], str(row.get("id", ""))


def normalise_triviaqa(row: dict, where: str) -> tuple[str, list[str], str]:
    question = _question(row, where)
    answer = row.get("answer")
    if not isinstance(answer, dict) or "aliases" not in answer:
        raise DataFormatError(f"{where}: field 'answer' must hold 'aliases'")
    # The canonical value first (the training target), then the aliases.
    answers = [answer.get("value") or ""] + list(answer.get("aliases") or [])
    answers += list(answer.get("normalized_aliases") or [])
    return question, [str(a) for a in answers], str(row.get("question_id", ""))


DATASETS = {
    "popqa": (normalise_popqa, "akariasai/PopQA", None, ["test"]),
    "triviaqa": (normalise_triviaqa, "mandarjoshi/trivia_qa", "rc.nocontext", ["validation"]),
}
_POOL_CACHE: dict[tuple, tuple[list[OpenQARecord], Counter]] = {}


class OpenQASource:
    """One split of PopQA or TriviaQA."""

    kind = "openqa"

    def __init__(
        self,
        dataset: str,
        split: str,
        hub_id: str | None = None,
        config: str | None = None,
        hub_splits=None,
        files=None,
        eval_size: int = 300,
        heldout_size: int = 1000,
        train_size: int | None = None,
        seed: int = 0,
        limit: int | None = None,
    ) -> None:
        if dataset not in DATASETS:
            raise ConfigError(f"open QA dataset {dataset!r} is not one of {', '.join(DATASETS)}")
        if split not in SPLITS:
            raise ConfigError(f"open QA split {split!r} is not one of {', '.join(SPLITS)}")
        normalise, default_id, default_config, default_splits = DATASETS[dataset]
        self.dataset, self.split, self.normalise = dataset, split, normalise
        self.hub_id = hub_id or default_id
        self.config = config if hub_id else default_config
        self.hub_splits = list(hub_splits or default_splits)
        self.files = [files] if isinstance(files, str) else (list(files) if files else None)
        self.sizes = {
            "eval": int(eval_size),
            "heldout": int(heldout_size),
            "train": None if train_size is None else int(train_size),
        }
        self.seed = int(seed)
        self.limit = limit
        self.name = f"{dataset}_{split}"
        self.skipped: Counter = Counter()

    def _pool(self) -> list[OpenQARecord]:
        key = (
            self.dataset,
            self.hub_id,
            self.config,
            tuple(self.hub_splits),
            tuple(self.files or ()),
        )
        if key not in _POOL_CACHE:
            records, skipped, seen = [], Counter(), set()
            for where, row in self._rows():
                question, answers, source_id = self.normalise(row, where)
                answers = list(dict.fromkeys(a.strip() for a in answers if a and a.strip()))
                if not answers:
                    skipped["no gold answer"] += 1
                    continue
                if question in seen:
                    skipped["duplicate question"] += 1
                    continue
                seen.add(question)
                records.append(
                    OpenQARecord(
                        id=f"{self.dataset}-{source_id or len(records)}",
                        question=question,
                        answers=tuple(answers),
                        source=self.dataset,
                    )
                )
            _POOL_CACHE[key] = (records, skipped)
        records, self.skipped = _POOL_CACHE[key]
        return records

    def _rows(self):
        if self.files:
            for path in self.files:
                for line, row in read_rows(path):
                    yield f"{path}, line {line}", row
            return
        for split in self.hub_splits:
            for number, row in hub_rows(self.hub_id, self.config, split, "setting.<split>.files"):
                yield f"{self.hub_id}[{split}], row {number}", row

    def _origin(self) -> str:
        if self.files:
            return ", ".join(file_labels(self.files))
        return f"{self.hub_id}:{self.config or '-'}:{'+'.join(self.hub_splits)}"

    def _check_room(self, pool: int) -> None:
        """Eval and held-out come first; the training split must keep at least one question."""
        n_eval, n_heldout = self.sizes["eval"], self.sizes["heldout"]
        room = {"eval": (pool, n_eval), "heldout": (pool - n_eval, n_heldout)}
        room["train"] = (pool - n_eval - n_heldout, 1)
        for split in ("eval", "heldout", "train"):
            available, asked = max(room[split][0], 0), room[split][1]
            if available < asked:
                raise DataSizeError(
                    f"{self.dataset} split '{split}': {available} questions available, {asked} "
                    f"asked ({self._origin()} has {pool} usable questions, too few for eval "
                    f"{n_eval} + held-out {n_heldout} + a training split; skipped "
                    f"{dict(self.skipped)}); lower eval_size / heldout_size",
                    split=split,
                    source=self._origin(),
                    available=available,
                    asked=asked,
                )

    def load(self) -> list[OpenQARecord]:
        pool = list(self._pool())
        random.Random(f"{self.seed}-{self.dataset}").shuffle(pool)
        self._check_room(len(pool))
        n_eval, n_heldout = self.sizes["eval"], self.sizes["heldout"]
        train = pool[n_eval + n_heldout :]
        if self.sizes["train"] is not None:
            train = train[: self.sizes["train"]]
        chosen = {
            "eval": pool[:n_eval],
            "heldout": pool[n_eval : n_eval + n_heldout],
            "train": train,
        }[self.split]
        return chosen[: self.limit] if self.limit else chosen

    def describe(self) -> dict:
        origin = [describe_file(f) for f in self.files] if self.files else self._origin()
        return {
            "name": self.name,
            "kind": self.kind,
            "origin": origin,
            "sizes": self.sizes,
            "seed": self.seed,
            "skipped": dict(self.skipped),
        }
