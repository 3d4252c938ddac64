"""The record types every data source is normalised to."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from calm_lightning.errors import DataFormatError

N_OPTIONS = 4


@dataclass(frozen=True)
class MCQARecord:
    """A multiple-choice question with `answer` indexing into `choices`."""

    id: str
    question: str
    choices: tuple[str, ...]
    answer: int
    source: str = ""
    subject: str = ""
    difficulty: str = ""

    def to_dict(self) -> dict:
        row = asdict(self)
        row["choices"] = list(self.choices)
        return row


@dataclass(frozen=True)
class InstructionRecord:
    """An instruction-following example in Alpaca's schema."""

    instruction: str
    input: str
    output: str
    id: str = ""


@dataclass(frozen=True)
class OpenQARecord:
    """An open-ended question with its gold answer aliases (the first is the training target)."""

    id: str
    question: str
    answers: tuple[str, ...]
    source: str = ""


def _where(path: str, line: int) -> str:
    return f"{path}, line {line}"


def _row_id(row: dict, path: str, line: int, name: str | None) -> str:
    """The row's own id, else `<file name>:<line>`: the directory stays out, so a prediction
    id (and the base cache's key) does not change when the data moves."""
    return str(row.get("id") or f"{name or Path(path).name}:{line}")


def required_text(row: dict, field: str, where: str) -> str:
    """`row[field]` as given, after checking that it is there and is non-empty text."""
    if field not in row:
        raise DataFormatError(f"{where}: missing field '{field}' (got {sorted(row)})")
    value = row[field]
    if not isinstance(value, str) or not value.strip():
        raise DataFormatError(f"{where}: field '{field}' is empty or not text")
    return value


def mcqa_from_row(
    row: dict, path: str, line: int, n_options: int = N_OPTIONS, name: str | None = None
) -> MCQARecord:
    """Validate a row in the project's MCQA schema; errors name the file, line and field.
    `name`: how an id-less row's id names the file (default: its name)."""
    where = _where(path, line)
    for field in ("question", "choices", "answer"):
        if field not in row:
            raise DataFormatError(f"{where}: missing field '{field}' (got {sorted(row)})")
    question = required_text(row, "question", where)
    choices = row["choices"]
    if not isinstance(choices, list | tuple) or not all(isinstance(c, str) for c in choices):
        raise DataFormatError(f"{where}: field 'choices' must be a list of strings")
    if len(choices) != n_options:
        raise DataFormatError(
            f"{where}: field 'choices' has {len(choices)} options, expected {n_options}"
        )
    answer = row["answer"]
    if isinstance(answer, bool) or not isinstance(answer, int):
        if isinstance(answer, str) and answer.strip().isdigit():
            answer = int(answer)
        else:
            raise DataFormatError(f"{where}: field 'answer' must be an integer, got {answer!r}")
    if not 0 <= answer < n_options:
        raise DataFormatError(f"{where}: field 'answer'={answer} is outside 0..{n_options - 1}")
    return MCQARecord(
        id=_row_id(row, path, line, name),
        question=question,
        choices=tuple(choices),
        answer=answer,
        source=str(row.get("source", "")),
        subject=str(row.get("subject", "")),
        difficulty=str(row.get("difficulty", "")),
    )


def instruction_from_row(
    row: dict, path: str, line: int, name: str | None = None
) -> InstructionRecord:
    """Validate a row in Alpaca's schema (`instruction`, `input`, `output`)."""
    where = _where(path, line)
    for field in ("instruction", "output"):
        required_text(row, field, where)
    extra = row.get("input") or ""
    if not isinstance(extra, str):
        raise DataFormatError(f"{where}: field 'input' must be text")
    return InstructionRecord(
        instruction=row["instruction"],
        input=extra,
        output=row["output"],
        id=_row_id(row, path, line, name),
    )


def openqa_from_row(row: dict, path: str, line: int, name: str | None = None) -> OpenQARecord:
    """Validate a row in the project's open-QA schema: `question` and `answers` (a list of
    gold aliases, the first being the training target; a JSON-encoded list is accepted)."""
    where = _where(path, line)
    for field in ("question", "answers"):
        if field not in row:
            raise DataFormatError(f"{where}: missing field '{field}' (got {sorted(row)})")
    question = required_text(row, "question", where)
    answers = row["answers"]
    if isinstance(answers, str):
        try:
            answers = json.loads(answers) if answers.lstrip().startswith("[") else [answers]
        except json.JSONDecodeError as err:
            raise DataFormatError(
                f"{where}: field 'answers' is not a JSON list ({err.msg})"
            ) from err
    if not isinstance(answers, list | tuple) or not all(isinstance(a, str) for a in answers):
        raise DataFormatError(f"{where}: field 'answers' must be a list of strings")
    answers = [a.strip() for a in answers if a.strip()]
    if not answers:
        raise DataFormatError(f"{where}: field 'answers' holds no gold answer")
    return OpenQARecord(
        id=_row_id(row, path, line, name),
        question=question.strip(),
        answers=tuple(answers),
        source=str(row.get("source", "")),
    )
