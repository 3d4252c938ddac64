"""The bundled demo data: reproducible, well-formed, and right where the answer can be computed."""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from tools.demo_data.build import split_items, write_demo_data

DEMO_DIR = Path(__file__).resolve().parents[1] / "calm_lightning" / "data" / "demo"
SPLITS = ("train", "heldout", "test")
MCQA_FILES = [f"mcqa_{s}.jsonl" for s in SPLITS]
INSTRUCTION_FILES = [f"instructions_{s}.jsonl" for s in SPLITS]
OPENQA_FILES = [f"openqa_{s}.jsonl" for s in SPLITS]

# The test's own unit table (size in the dimension's base unit), kept apart from the generator's
# so that a wrong factor there cannot also pass here.
UNIT_SIZES = {
    "millimetre": ("length", Fraction(1, 1000)),
    "centimetre": ("length", Fraction(1, 100)),
    "metre": ("length", Fraction(1)),
    "kilometre": ("length", Fraction(1000)),
    "inch": ("length", Fraction("0.0254")),
    "foot": ("length", Fraction("0.3048")),
    "milligram": ("mass", Fraction(1, 1000)),
    "gram": ("mass", Fraction(1)),
    "kilogram": ("mass", Fraction(1000)),
    "tonne": ("mass", Fraction(10**6)),
    "millilitre": ("volume", Fraction(1, 1000)),
    "cubic centimetre": ("volume", Fraction(1, 1000)),
    "litre": ("volume", Fraction(1)),
    "second": ("time", Fraction(1)),
    "minute": ("time", Fraction(60)),
    "hour": ("time", Fraction(60 * 60)),
    "day": ("time", Fraction(24 * 60 * 60)),
    "week": ("time", Fraction(7 * 24 * 60 * 60)),
}
PLURALS = {"inch": "inches", "foot": "feet"}
UNIT_BY_NAME = {}
for _singular, _size in UNIT_SIZES.items():
    UNIT_BY_NAME[_singular] = _size
    UNIT_BY_NAME[PLURALS.get(_singular, _singular + "s")] = _size


def _read(name: str) -> list[dict]:
    lines = (DEMO_DIR / name).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


@pytest.fixture(scope="module")
def mcqa() -> dict[str, list[dict]]:
    return {s: _read(f"mcqa_{s}.jsonl") for s in SPLITS}


@pytest.fixture(scope="module")
def instructions() -> dict[str, list[dict]]:
    return {s: _read(f"instructions_{s}.jsonl") for s in SPLITS}


def _all(splits: dict[str, list[dict]]) -> list[dict]:
    return [row for rows in splits.values() for row in rows]


def _evaluate(expression: str) -> Fraction:
    """Exact value of an expression made of integers, + - × ÷ and brackets."""
    tree = ast.parse(expression.replace("×", "*").replace("÷", "/"), mode="eval")
    ops = {
        ast.Add: Fraction.__add__,
        ast.Sub: Fraction.__sub__,
        ast.Mult: Fraction.__mul__,
        ast.Div: Fraction.__truediv__,
    }

    def value(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return Fraction(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](value(node.left), value(node.right))
        raise AssertionError(f"unexpected syntax in {expression!r}: {ast.dump(node)}")

    return value(tree)


def _convert(question: str) -> Fraction:
    """The exact answer to a unit question, from the question text alone."""
    if m := re.fullmatch(r"How many (.+) are in ([\d.]+) (.+)\?", question):
        target, amount, source = m.groups()
    elif m := re.fullmatch(r"What is ([\d.]+) (.+) in (.+)\?", question):
        amount, source, target = m.groups()
    else:
        raise AssertionError(f"unparsed unit question: {question!r}")
    (dim_from, size_from), (dim_to, size_to) = UNIT_BY_NAME[source], UNIT_BY_NAME[target]
    assert dim_from == dim_to, question
    return Fraction(amount) * size_from / size_to


def test_committed_files_match_a_fresh_generation(tmp_path):
    counts = write_demo_data(tmp_path)
    assert sorted(counts) == sorted(MCQA_FILES + INSTRUCTION_FILES + OPENQA_FILES)
    for name, n_rows in counts.items():
        committed = (DEMO_DIR / name).read_bytes()
        assert committed == (tmp_path / name).read_bytes(), (
            f"{name} is stale: rerun python -m tools.demo_data.build"
        )
        assert committed.endswith(b"\n") and committed.count(b"\n") == n_rows


def test_mcqa_sizes_subjects_and_difficulties(mcqa):
    items = _all(mcqa)
    assert len(items) >= 600
    subjects = {it["subject"] for it in items}
    assert len(subjects) >= 4
    assert {it["difficulty"] for it in items} == {"easy", "medium", "hard"}
    for split, rows in mcqa.items():
        assert {it["subject"] for it in rows} == subjects, f"{split} misses a subject"
    # The split sizes the demo configs were written for.
    assert [len(mcqa[s]) for s in SPLITS] == [240, 160, 320]


def test_mcqa_rows_are_well_formed(mcqa):
    items = _all(mcqa)
    for it in items:
        assert set(it) == {"id", "question", "choices", "answer", "source", "subject", "difficulty"}
        assert it["id"].startswith(f"mcqa-{it['subject']}-")
        assert it["source"] == "demo"
        assert isinstance(it["question"], str) and it["question"].strip()
        choices = it["choices"]
        assert len(choices) == 4 and len(set(choices)) == 4, it
        assert all(isinstance(c, str) and c.strip() for c in choices), it
        assert type(it["answer"]) is int and 0 <= it["answer"] <= 3, it
    ids = [it["id"] for it in items]
    assert len(set(ids)) == len(ids)


def test_arithmetic_answers_are_right(mcqa):
    items = [it for it in _all(mcqa) if it["subject"] == "arithmetic"]
    assert items
    for it in items:
        m = re.fullmatch(r"What is (.+)\?", it["question"])
        assert m, it["question"]
        expected = _evaluate(m.group(1))
        matches = [i for i, c in enumerate(it["choices"]) if Fraction(c) == expected]
        assert matches == [it["answer"]], it


def test_unit_answers_are_right(mcqa):
    items = [it for it in _all(mcqa) if it["subject"] == "units"]
    assert items
    for it in items:
        expected = _convert(it["question"])
        matches = [i for i, c in enumerate(it["choices"]) if Fraction(c) == expected]
        assert matches == [it["answer"]], it


def test_answer_positions_are_balanced(mcqa):
    for rows in [*mcqa.values(), _all(mcqa)]:
        counts = Counter(it["answer"] for it in rows)
        for pos in range(4):
            assert 0.15 <= counts[pos] / len(rows) <= 0.35, counts


def test_no_question_is_repeated_or_shared_between_splits(mcqa, instructions):
    questions = [it["question"] for it in _all(mcqa)]
    assert len(set(questions)) == len(questions)
    prompts = [(r["instruction"], r["input"]) for r in _all(instructions)]
    assert len(set(prompts)) == len(prompts)
    for kind in (mcqa, instructions):
        seen: dict[str, str] = {}
        for split in SPLITS:
            for row in kind[split]:
                text = row.get("question") or f"{row.get('instruction')}\n{row.get('input')}"
                assert seen.setdefault(text, split) == split, f"{text!r} in two splits"


def test_instruction_rows_follow_the_alpaca_schema(instructions):
    rows = _all(instructions)
    assert [len(instructions[s]) for s in SPLITS] == [480, 100, 100]
    for row in rows:
        assert set(row) == {"instruction", "input", "output"}, row
        assert all(isinstance(v, str) for v in row.values()), row
        assert row["instruction"].strip() and row["output"].strip(), row
        # Full-sentence answers of one to three sentences.
        sentences = re.split(r"(?<=[.!?])\s+(?=[A-Z0-9])", row["output"])
        assert row["output"].endswith(".") and 1 <= len(sentences) <= 3, row
    with_input = sum(1 for r in rows if r["input"])
    assert 0.3 <= with_input / len(rows) <= 0.7


def test_split_items_is_deterministic_and_stratified():
    items = [{"k": k, "n": n} for k in "abc" for n in range(30)]
    fractions = {"x": 0.5, "y": 0.3, "z": 0.2}
    first = split_items(items, fractions, seed=3, key="k")
    assert first == split_items(items, fractions, seed=3, key="k")
    assert [len(first[s]) for s in fractions] == [45, 27, 18]
    for rows in first.values():
        assert Counter(r["k"] for r in rows) == Counter({k: len(rows) // 3 for k in "abc"})
    assert sorted(map(str, _all(first))) == sorted(map(str, items))
    # `spread` deals each value of a second key out in proportion too.
    spread = split_items(items, fractions, seed=3, key="k", spread=lambda r: r["n"] % 2)
    for rows in spread.values():
        parity = Counter(r["n"] % 2 for r in rows)
        assert abs(parity[0] - parity[1]) <= 3  # off by at most one per stratum
    with pytest.raises(ValueError):
        split_items(items, {"x": 0.5, "y": 0.2}, seed=0)


def test_openqa_demo_splits_shift_subjects_and_keep_gold_answers(mcqa):
    from calm_lightning.data.sources import EmbeddedDemoSource

    splits = {s: EmbeddedDemoSource("openqa", s).load() for s in SPLITS}
    assert {s: len(r) for s, r in splits.items()} == {"train": 288, "heldout": 144, "test": 250}
    subjects = {
        s: {_read(f"openqa_{s}.jsonl")[i]["subject"] for i in range(len(r))}
        for s, r in splits.items()
    }
    assert subjects["train"] == subjects["heldout"] == {"chemistry", "units", "arithmetic"}
    assert subjects["test"] == {"geography", "biology"}
    ids = [r.id for rows in splits.values() for r in rows]
    assert len(set(ids)) == len(ids)
    # Each open question is an MCQA question whose correct option is the first gold answer.
    gold = {it["question"]: it["choices"][it["answer"]] for it in _all(mcqa)}
    for record in (r for rows in splits.values() for r in rows):
        assert gold[record.question] == record.answers[0]
        assert not record.question.startswith("Which of these")
