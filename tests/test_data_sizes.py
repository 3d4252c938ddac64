"""Hub-schema files at the real sizes, written here (our own text; the row counts are the hubs'
own, from their dataset cards): Alpaca's 52,002 rows with 28 empty outputs cut by raw index, the
MCQA sources' pools at the paper's sizes, and the errors that name a split too large for its
data."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from calm_lightning.data import alpaca, mcqa
from calm_lightning.data.alpaca import AlpacaSource
from calm_lightning.data.mcqa import MCQASource
from calm_lightning.errors import DataSizeError

ALPACA_ROWS = 52_002  # tatsu-lab/alpaca, one split
MCQA_ROWS = {  # rows per hub split
    "mmlu": {"test": 14_042, "validation": 1_531, "dev": 285},  # cais/mmlu, config all
    "medmcqa": {"validation": 4_183, "train": 182_822, "test": 6_150},  # test: cop = -1
    "openbookqa": {"train": 4_957, "validation": 500, "test": 500},  # config main
    "arc_challenge": {"train": 1_119, "validation": 299, "test": 1_172},  # ARC-Challenge
}
PAPER = {"train": 2000, "calibration": 1000, "test": 2000, "ood_test": 3000}
UNLABELLED = "unlabelled (cop = -1, the hub's test split)"

# 28 empty outputs (tatsu-lab/stanford_alpaca issue #265), scattered over the paper's three
# blocks of raw rows: 20 in the first 48,002, 5 in the next 2,000, 3 in the last 2,000.
_pick = random.Random(265)
EMPTY = {
    "train": set(_pick.sample(range(0, 48_002), 20)),
    "heldout": set(_pick.sample(range(48_002, 50_002), 5)),
    "test": set(_pick.sample(range(50_002, 52_002), 3)),
}
ALL_EMPTY = set().union(*EMPTY.values())


@pytest.fixture(autouse=True)
def _fresh_caches():
    """The sources keep parsed pools per process; these are large, so none outlives its test."""
    yield
    alpaca._ROWS_CACHE.clear()
    mcqa._POOL_CACHE.clear()


def _write(path: Path, rows) -> Path:
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def _sha16(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _alpaca_rows(n: int):
    for i in range(n):
        yield {
            "instruction": f"Describe item number {i} in one sentence.",
            "input": f"item {i}" if i % 3 == 0 else "",
            "output": "" if i in ALL_EMPTY else f"Item {i} is an item.",
            "text": "",
        }


def _mcqa_rows(source: str, split: str, n: int):
    """Rows in each hub's schema; ARC gets some 3- and 5-option items and some digit labels."""
    for i in range(n):
        texts = [f"{source} {split} {i} option {k}" for k in range(4)]
        question = f"In {source} {split}, which option fits case {i}?"
        if source == "mmlu":
            yield {"question": question, "subject": "anatomy", "choices": texts, "answer": i % 4}
        elif source == "medmcqa":
            ops = dict(zip(("opa", "opb", "opc", "opd"), texts, strict=True))
            cop = -1 if split == "test" else i % 4
            yield {"id": f"{split}-{i}", "question": question, **ops, "cop": cop}
        elif source == "openbookqa":
            yield {
                "id": f"{split}-{i}",
                "question_stem": question,
                "choices": {"text": texts, "label": list("ABCD")},
                "answerKey": "ABCD"[i % 4],
            }
        else:
            k = 3 if i % 150 == 7 else 5 if i % 211 == 11 else 4
            texts += [f"{source} {split} {i} option 4"]
            labels = list("12345") if i % 50 == 3 else list("ABCDE")
            yield {
                "id": f"Mercury_{split}_{i}",
                "question": question,
                "choices": {"text": texts[:k], "label": labels[:k]},
                "answerKey": labels[i % k],
            }


def _mcqa_files(folder: Path, rows: dict[str, dict[str, int]]) -> dict[str, list[Path]]:
    return {
        source: [
            _write(folder / f"{source}_{split}.jsonl", _mcqa_rows(source, split, n))
            for split, n in splits.items()
        ]
        for source, splits in rows.items()
    }


def _sources(files: dict[str, list[Path]]) -> dict:
    return {
        name: {"hub_id": f"hub/{name}", "splits": ["x"], "files": [str(p) for p in paths]}
        for name, paths in files.items()
    }


@pytest.fixture(scope="module")
def alpaca_file(tmp_path_factory) -> Path:
    return _write(tmp_path_factory.mktemp("alpaca") / "alpaca.jsonl", _alpaca_rows(ALPACA_ROWS))


@pytest.fixture(scope="module")
def mcqa_files(tmp_path_factory) -> dict[str, list[Path]]:
    """Every MCQA source at its real size, but MedMCQA without its 182,822-row train split
    (seconds to write and read; the integration test below reads it)."""
    rows = {name: dict(splits) for name, splits in MCQA_ROWS.items()}
    del rows["medmcqa"]["train"]
    return _mcqa_files(tmp_path_factory.mktemp("mcqa"), rows)


# ----- Alpaca -----


def test_alpaca_blocks_are_raw_rows_and_empty_outputs_are_counted_per_split(alpaca_file):
    sources = {split: AlpacaSource(split, files=[str(alpaca_file)]) for split in EMPTY}
    records = {split: source.load() for split, source in sources.items()}
    raw = {
        "train": range(0, 48_002),
        "heldout": range(48_002, 50_002),
        "test": range(50_002, 52_002),
    }
    for split, rows in raw.items():
        assert [r.id for r in records[split]] == [f"alpaca-{i}" for i in rows if i not in ALL_EMPTY]
    assert [len(records[s]) for s in raw] == [47_982, 1_995, 1_997]
    ids = [r.id for split in raw for r in records[split]]
    assert len(set(ids)) == len(ids) == ALPACA_ROWS - 28  # disjoint, every usable row once
    assert records["test"][-1].output == "Item 52001 is an item."
    assert records["train"][0].input == "item 0" and records["train"][1].input == ""
    summary = sources["heldout"].describe()
    assert summary["origin"] == [{"name": "alpaca.jsonl", "sha256": _sha16(alpaca_file)}]
    assert summary["raw_rows"] == ALPACA_ROWS and summary["skipped"] == {"empty output": 5}
    assert summary["blocks"] == {
        split: {
            "raw_rows": [rows.start, rows.stop],
            "kept": len(rows) - len(EMPTY[split]),
            "dropped": {"empty output": len(EMPTY[split])},
        }
        for split, rows in raw.items()
    }
    assert sources["train"].describe()["skipped"] == {"empty output": 20}


def test_alpaca_blocks_past_the_data_name_the_split_source_and_rows(alpaca_file, tmp_path):
    short = tmp_path / "alpaca_short.jsonl"
    short.write_text("".join(alpaca_file.read_text().splitlines(keepends=True)[:52_001]))
    with pytest.raises(DataSizeError) as err:
        AlpacaSource("train", files=[str(short)]).load()  # the test block no longer fits
    assert (err.value.split, err.value.source) == ("test", "alpaca_short.jsonl")
    assert (err.value.available, err.value.asked) == (1_999, 2_000)
    message = str(err.value)
    assert "52001 raw rows" in message and "test_size" in message
    assert str(tmp_path) not in message
    with pytest.raises(DataSizeError) as err:
        AlpacaSource("heldout", files=[str(short)], train_size=51_000).load()
    assert (err.value.split, err.value.available, err.value.asked) == ("heldout", 1_001, 2_000)
    fitted = AlpacaSource("test", files=[str(short)], test_size=1_999).load()
    assert [r.id for r in fitted] == [
        f"alpaca-{i}" for i in range(50_002, 52_001) if i not in ALL_EMPTY
    ]


# ----- MCQA -----


def test_mcqa_paper_sizes_load_disjointly_from_real_size_pools(mcqa_files):
    sources = _sources(mcqa_files)
    loaded = {split: MCQASource(split, sources, PAPER) for split in PAPER}
    splits = {split: source.load() for split, source in loaded.items()}
    assert {split: len(records) for split, records in splits.items()} == PAPER
    ids = [r.id for records in splits.values() for r in records]
    assert len(set(ids)) == len(ids) == sum(PAPER.values())
    for split, records in splits.items():  # every source has over 2,000 usable questions,
        for name in sources:  # so the round robin gives each a quarter of every split
            assert sum(r.source == name for r in records) == PAPER[split] // 4, (split, name)
    arc_rows = [r for p in mcqa_files["arc_challenge"] for r in map(json.loads, p.open())]
    options = [len(r["choices"]["text"]) for r in arc_rows]
    summary = loaded["ood_test"].describe()
    assert summary["per_source"] == {
        "mmlu": {"rows": 15_858, "kept": 15_858, "duplicates": 0, "skipped": {}},
        "medmcqa": {"rows": 10_333, "kept": 4_183, "duplicates": 0, "skipped": {UNLABELLED: 6_150}},
        "openbookqa": {"rows": 5_957, "kept": 5_957, "duplicates": 0, "skipped": {}},
        "arc_challenge": {
            "rows": 2_590,
            "kept": options.count(4),
            "duplicates": 0,
            "skipped": {"3 options": options.count(3), "5 options": options.count(5)},
        },
    }
    assert options.count(3) and options.count(5)
    assert summary["sources"]["mmlu"] == [
        {"name": p.name, "sha256": _sha16(p)} for p in mcqa_files["mmlu"]
    ]


def test_mcqa_split_larger_than_its_pool_names_the_split_sources_and_rows(tmp_path):
    small = {"mmlu": {"test": 1500}, "medmcqa": {"validation": 1500}}
    small |= {"openbookqa": {"train": 1500}, "arc_challenge": {"test": 1520}}
    files = _mcqa_files(tmp_path, small)
    arc = [len(json.loads(line)["choices"]["text"]) for line in files["arc_challenge"][0].open()]
    pool = 4500 + arc.count(4)
    assert len(MCQASource("test", _sources(files), PAPER).load()) == 2000  # its block fits
    with pytest.raises(DataSizeError) as err:
        MCQASource("ood_test", _sources(files), PAPER).load()
    facts = (err.value.split, err.value.available, err.value.asked)
    assert facts == ("ood_test", pool - 5000, 3000)
    message = str(err.value)
    for name in ("mmlu_test.jsonl", "medmcqa_validation.jsonl", "arc_challenge_test.jsonl"):
        assert name in err.value.source and name in message
    assert f"pool holds {pool} usable questions" in message and "sizes.ood_test" in message
    assert "'3 options'" in message and str(tmp_path) not in message
    capped = MCQASource("ood_test", _sources(files), PAPER, allow_fewer=True).load()
    assert len(capped) == pool - 5000


@pytest.mark.integration
def test_ood_at_the_paper_sizes_loads_from_real_size_files(
    tmp_path, compose, alpaca_file, mcqa_files
):
    """setting=ood as the paper runs it: all of Alpaca, the MCQA pool with MedMCQA's train."""
    from calm_lightning.evaluation.scorers import scorer_from_config
    from calm_lightning.pipeline import build_datamodule

    files = dict(mcqa_files)
    files["medmcqa"] = [
        *files["medmcqa"],
        *_mcqa_files(tmp_path, {"medmcqa": {"train": 182_822}})["medmcqa"],
    ]
    overrides = ["setting=ood", f"setting.train.files=[{alpaca_file}]"]
    overrides += [
        f"setting.test.sources.{name}.files=[{','.join(map(str, paths))}]"
        for name, paths in files.items()
    ]
    cfg = compose(overrides, tmp_path)
    datamodule = build_datamodule(cfg, scorer_from_config(cfg.evaluation))
    records = datamodule.load_records()
    assert [len(records[s]) for s in ("train", "heldout", "test")] == [47_982, 1_995, 3_000]
    summary = json.loads(json.dumps(datamodule.summary()))  # as data_summary.json holds it
    assert summary["heldout"]["skipped"] == {"empty output": 5}
    assert summary["train"]["blocks"]["test"]["dropped"] == {"empty output": 3}
    assert summary["test"]["per_source"]["medmcqa"]["kept"] == 4_183 + 182_822
    assert str(tmp_path) not in json.dumps(summary)
