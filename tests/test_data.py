"""Local data files, record validation, and collation (left padding for scoring,
response-only labels and truncation accounting for training)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from calm_lightning.data import files
from calm_lightning.data.collate import IGNORE_INDEX, InstructionCollator, MCQACollator
from calm_lightning.data.datamodule import as_training_example
from calm_lightning.data.records import InstructionRecord, MCQARecord
from calm_lightning.data.sources import LocalFileSource, load_records
from calm_lightning.errors import ConfigError, DataFormatError

GOOD = {"question": "2 + 3 = ?", "choices": ["4", "5", "6", "7"], "answer": 1}


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_reads_every_supported_format(tmp_path):
    rows = [dict(GOOD, id=f"q{i}") for i in range(3)]
    jsonl = _jsonl(tmp_path / "a.jsonl", rows)
    as_json = tmp_path / "a.json"
    as_json.write_text(json.dumps(rows))
    csv = tmp_path / "a.csv"
    csv.write_text(
        "id,question,choices,answer\n"
        + "".join(f'q{i},"2 + 3 = ?","[""4"", ""5"", ""6"", ""7""]",1\n' for i in range(3))
    )
    tsv = tmp_path / "a.tsv"
    tsv.write_text(
        "id\tquestion\tchoices\tanswer\n"
        + "".join(f'q{i}\t2 + 3 = ?\t["4", "5", "6", "7"]\t1\n' for i in range(3))
    )
    for path in (jsonl, as_json, csv, tsv):
        records = load_records("mcqa", [path])
        assert [r.id for r in records] == ["q0", "q1", "q2"], path.suffix
        assert records[0] == MCQARecord("q0", "2 + 3 = ?", ("4", "5", "6", "7"), 1)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "the file is empty"),
        ("\n\n", "holds no rows"),
        (json.dumps(GOOD) + "\n{not json\n", "line 2: invalid JSON"),
        (json.dumps({"question": "q", "answer": 0}) + "\n", "line 1: missing field 'choices'"),
        (json.dumps(dict(GOOD, choices=["a", "b", "c"])) + "\n", "has 3 options, expected 4"),
        (json.dumps(dict(GOOD, answer="B")) + "\n", "'answer' must be an integer"),
        (json.dumps(dict(GOOD, answer=4)) + "\n", "outside 0..3"),
        (json.dumps(dict(GOOD, question="  ")) + "\n", "'question' is empty"),
        ("[1, 2]\n", "expected an object"),
    ],
)
def test_malformed_files_name_the_file_line_and_field(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataFormatError) as err:
        load_records("mcqa", [path])
    assert str(path) in str(err.value) and message in str(err.value)


def test_instruction_rows_and_unknown_inputs(tmp_path):
    path = _jsonl(
        tmp_path / "i.jsonl",
        [
            {"instruction": "Say hi.", "input": "", "output": "Hi."},
            {"instruction": "Add.", "input": "2 and 3", "output": "5"},
        ],
    )
    records = LocalFileSource("instruction", [str(path)]).load()
    assert records[1] == InstructionRecord("Add.", "2 and 3", "5", "i.jsonl:2")
    bad = _jsonl(tmp_path / "j.jsonl", [{"instruction": "x", "input": ""}])
    with pytest.raises(DataFormatError, match="line 1: missing field 'output'"):
        load_records("instruction", [bad])
    (tmp_path / "x.txt").write_text("a")
    with pytest.raises(DataFormatError, match="unsupported file type"):
        load_records("mcqa", [tmp_path / "x.txt"])
    with pytest.raises(ConfigError, match="not one of"):
        load_records("essay", [path])


def test_data_files_are_recorded_by_name_and_content_hash(tmp_path, monkeypatch):
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    first = _jsonl(tmp_path / "one" / "a.jsonl", [GOOD])
    second = _jsonl(tmp_path / "two" / "a.jsonl", [GOOD, dict(GOOD, question="3 + 3 = ?")])
    source = LocalFileSource("mcqa", [str(first), str(second)])
    # Id-less rows are named by file name and line; a name two files share gets its position.
    assert [r.id for r in source.load()] == ["a.jsonl#1:1", "a.jsonl#2:1", "a.jsonl#2:2"]
    digest = [hashlib.sha256(p.read_bytes()).hexdigest()[:16] for p in (first, second)]
    summary = source.describe()
    assert summary["files"] == [{"name": "a.jsonl", "sha256": d} for d in digest]
    assert digest[0] != digest[1] and str(tmp_path) not in json.dumps(summary)
    hashed = []
    sha256 = hashlib.sha256
    monkeypatch.setattr(files.hashlib, "sha256", lambda: hashed.append(1) or sha256())
    assert files.content_hash(first) == digest[0] and not hashed  # once per file version
    _jsonl(first, [dict(GOOD, question="20 + 30 = ?")])  # another size: a new version
    assert files.content_hash(first) == sha256(first.read_bytes()).hexdigest()[:16]
    assert len(hashed) == 1


def test_mcqa_collator_left_pads(tokenizer):
    records = [
        MCQARecord("a", "Short?", ("1", "2", "3", "4"), 0),
        MCQARecord("b", "A much longer question with more words?", ("1", "2", "3", "4"), 3),
    ]
    batch = MCQACollator(tokenizer)(records)
    mask, ids = batch["attention_mask"], batch["input_ids"]
    assert mask[:, -1].tolist() == [1, 1]  # the answer slot is last in every row
    assert mask[0, 0] == 0 and mask[1].all()  # the shorter row is padded on the left
    assert (ids[0][mask[0] == 0] == tokenizer.pad_token_id).all()
    assert batch["labels"].tolist() == [0, 3] and batch["ids"] == ["a", "b"]


def test_mcqa_collator_counts_cut_questions_once_over_several_passes(tokenizer):
    """The data summary's `test_prompts_truncated` counts questions, not scoring passes: a
    run that scores the base row and one that reads it from the cache report the same."""
    records = [
        MCQARecord("short", "Short?", ("1", "2", "3", "4"), 0),
        MCQARecord("long", "word " * 200 + "?", ("1", "2", "3", "4"), 1),
    ]
    short = MCQACollator(tokenizer)(records[:1])["input_ids"].shape[1]
    collate = MCQACollator(tokenizer, max_length=short + 5)
    for _ in range(2):  # base pass, method pass
        batch = collate(records)
        assert batch["input_ids"].shape[1] == short + 5  # the long one was cut
    assert collate.truncated == 1


def test_instruction_labels_cover_exactly_the_response(tokenizer):
    records = [
        InstructionRecord("Name the capital of France.", "", "The capital is Paris."),
        InstructionRecord("Add the numbers.", "2 and 3", "2 + 3 = 5."),
    ]
    batch = InstructionCollator(tokenizer, max_length=256)(records)
    for row in range(2):
        labels = batch["labels"][row]
        kept = labels[labels != IGNORE_INDEX]
        text = tokenizer.decode(kept)
        assert text == records[row].output + "<|im_end|>\n"
        # Labels line up with inputs where they are not masked (no shift in the collator).
        ids = batch["input_ids"][row]
        assert torch.equal(ids[labels != IGNORE_INDEX], kept)
    # Right padding: the shorter row ends with mask zeros and ignored labels.
    short = int(batch["attention_mask"].sum(1).argmin())
    assert batch["attention_mask"][short, -1] == 0 and batch["labels"][short, -1] == IGNORE_INDEX


def test_truncation_keeps_the_response_start_and_is_counted(tokenizer):
    long_prompt = InstructionRecord("Summarise: " + "words " * 200, "", "Short answer.")
    long_answer = InstructionRecord("Talk.", "", "blah " * 200)
    collator = InstructionCollator(tokenizer, max_length=64)
    ids, labels = collator.encode(long_prompt)
    assert len(ids) == 64
    response = [t for t in labels if t != IGNORE_INDEX]
    assert tokenizer.decode(response).startswith("Short answer.")
    ids, labels = collator.encode(long_answer)
    assert len(ids) <= 64
    assert collator.stats == {"prompt_truncated": 2, "response_truncated": 1}


def test_mcqa_trains_on_the_answer_letter():
    example = as_training_example(MCQARecord("x", "Q?", ("a", "b", "c", "d"), 2))
    assert example.output == "C" and "C. c" in example.instruction
