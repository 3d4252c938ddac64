"""The paper's data families from local files in each hub dataset's own schema (fixtures in
tests/fixtures/hub, our own text): normalisation, deterministic splits, skip counts, errors,
the settings' loaders, the offline message, and base runs of `ood` / `id` on the tiny model."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hydra.utils import instantiate

from calm_lightning.data import alpaca, mcqa, openqa
from calm_lightning.data.alpaca import AlpacaSource
from calm_lightning.data.collate import IGNORE_INDEX
from calm_lightning.data.mcqa import MCQASource, SourceSpec, read_source
from calm_lightning.data.openqa import OpenQASource
from calm_lightning.errors import DataFormatError, DataSizeError, DataUnavailableError
from calm_lightning.evaluation.scorers import scorer_from_config
from calm_lightning.pipeline import build_datamodule, run_experiment

HUB = Path(__file__).parent / "fixtures" / "hub"
SIZES = {"train": 4, "calibration": 2, "test": 4, "ood_test": 4}
MCQA_FILES = {
    name: str(HUB / f"{name}.jsonl") for name in ("mmlu", "medmcqa", "openbookqa", "arc_challenge")
}


@pytest.fixture(autouse=True)
def _fresh_caches():
    """Sources cache parsed pools per process; tests write different files under one name."""
    for module in (alpaca, mcqa, openqa):
        next(v for k, v in vars(module).items() if k.endswith("_CACHE")).clear()


def _mcqa_sources() -> dict:
    return {
        name: {"hub_id": f"hub/{name}", "splits": ["x"], "files": [path]}
        for name, path in MCQA_FILES.items()
    }


# ----- per-source normalisation -----


def test_mmlu_and_medmcqa_normalise_and_count_skips():
    records, stats = read_source(SourceSpec("mmlu", "cais/mmlu", files=[MCQA_FILES["mmlu"]]))
    assert len(records) == 6 and stats.skipped == {"3 options": 1}
    first = records[0]
    assert first.question == "Which number is 2 more than 4?"
    assert first.choices == ("6", "7", "5", "2") and first.answer == 0
    assert first.source == "mmlu" and first.subject == "elementary_mathematics"
    assert first.id == "mmlu-mmlu.jsonl-1"  # MMLU has no ids: file name and line, no directory
    records, stats = read_source(SourceSpec("medmcqa", "x", files=[MCQA_FILES["medmcqa"]]))
    assert len(records) == 6 and stats.skipped == {"unlabelled (cop = -1, the hub's test split)": 1}
    assert records[0].choices == ("Kidney", "Stomach", "Lung", "Skin") and records[0].answer == 0
    assert records[0].id == "medmcqa-med0" and records[0].subject == "Physiology"


def test_openbookqa_and_arc_digit_labels():
    records, _ = read_source(SourceSpec("openbookqa", "x", files=[MCQA_FILES["openbookqa"]]))
    assert records[0].question.startswith("A plant kept in a dark room") and records[0].answer == 1
    records, stats = read_source(
        SourceSpec("arc_challenge", "x", files=[MCQA_FILES["arc_challenge"]])
    )
    digit = next(r for r in records if r.id == "arc_challenge-arc0")
    assert digit.choices == ("a ruler", "a balance", "a thermometer", "a compass")
    assert digit.answer == 1  # answerKey "2" among labels "1".."4"
    assert stats.skipped == {"3 options": 1, "5 options": 1} and stats.kept == 6


@pytest.mark.parametrize(
    ("name", "row", "message"),
    [
        ("mmlu", {"question": "q", "choices": ["a", "b", "c", "d"]}, "missing field 'answer'"),
        (
            "mmlu",
            {"question": "q", "choices": ["a", "b", "c", "d"], "answer": "B"},
            "'answer' must be an integer",
        ),
        (
            "mmlu",
            {"question": " ", "choices": ["a", "b", "c", "d"], "answer": 1},
            "'question' is empty",
        ),
        (
            "medmcqa",
            {"question": "q", "opa": "a", "opb": "b", "opc": "c", "cop": 1},
            "missing field 'opd'",
        ),
        (
            "arc_challenge",
            {
                "question": "q",
                "choices": {"text": list("abcd"), "label": list("ABCD")},
                "answerKey": "E",
            },
            "answerKey 'E' is not one of the labels",
        ),
    ],
)
def test_malformed_rows_name_file_row_and_field(tmp_path, name, row, message):
    path = tmp_path / f"{name}.jsonl"
    path.write_text(json.dumps({"id": "ok"} | row) + "\n")
    with pytest.raises(DataFormatError) as err:
        read_source(SourceSpec(name, "x", files=[str(path)]))
    assert f"{path}, row 1" in str(err.value) and message in str(err.value)


# ----- splits -----


def test_mcqa_splits_are_disjoint_deterministic_and_mix_sources():
    splits = {s: MCQASource(s, _mcqa_sources(), SIZES, seed=3).load() for s in SIZES}
    assert {s: len(r) for s, r in splits.items()} == SIZES
    ids = [r.id for records in splits.values() for r in records]
    assert len(ids) == len(set(ids))
    assert {r.source for r in splits["train"]} == set(MCQA_FILES)  # round-robin over sources
    mcqa._POOL_CACHE.clear()
    again = MCQASource("test", _mcqa_sources(), SIZES, seed=3).load()
    assert [r.id for r in again] == [r.id for r in splits["test"]]
    mcqa._POOL_CACHE.clear()
    other = MCQASource("test", _mcqa_sources(), SIZES, seed=4).load()
    assert [r.id for r in other] != [r.id for r in splits["test"]]


def test_alpaca_splits_follow_the_paper_order():
    kwargs = {
        "files": [str(HUB / "alpaca.jsonl")],
        "train_size": 8,
        "heldout_size": 3,
        "test_size": 2,
    }
    train = AlpacaSource("train", **kwargs).load()
    heldout = AlpacaSource("heldout", **kwargs).load()
    test = AlpacaSource("test", **kwargs)
    test_records = test.load()
    assert [r.id for r in train] == [f"alpaca-{i}" for i in range(8)]
    assert [r.id for r in heldout] == [f"alpaca-{i}" for i in range(8, 11)]
    # The last 2 raw rows (13, 14); row 14 has an empty output and is dropped, not replaced.
    assert [r.id for r in test_records] == ["alpaca-13"]
    assert test.describe()["skipped"] == {"empty output": 1}
    assert test.describe()["blocks"]["test"] == {
        "raw_rows": [13, 15],
        "kept": 1,
        "dropped": {"empty output": 1},
    }
    assert train[1].input == "" and train[0].input == "the numbers 0 and 3"
    with pytest.raises(DataSizeError) as err:
        AlpacaSource("train", files=kwargs["files"]).load()  # paper sizes need 52,002 rows
    assert (err.value.split, err.value.available, err.value.asked) == ("train", 15, 48002)
    assert err.value.source == "alpaca.jsonl" and "train_size" in str(err.value)


def test_open_qa_sources_normalise_aliases_and_split():
    pop = {
        s: OpenQASource(
            "popqa", s, files=[str(HUB / "popqa.jsonl")], eval_size=3, heldout_size=3
        ).load()
        for s in ("train", "heldout", "eval")
    }
    assert [len(pop[s]) for s in ("train", "heldout", "eval")] == [6, 3, 3]
    assert pop["eval"][0].answers == ("Examplia", "Examplia Republic")
    assert len({r.id for recs in pop.values() for r in recs}) == 12
    trivia = OpenQASource(
        "triviaqa", "eval", files=[str(HUB / "triviaqa.jsonl")], eval_size=3, heldout_size=3
    ).load()
    assert trivia[0].answers == ("Green", "green colour", "green")  # value first, deduplicated
    popqa = HUB / "popqa.jsonl"
    source = OpenQASource("popqa", "eval", files=[str(popqa)], eval_size=10, heldout_size=3)
    with pytest.raises(DataSizeError) as err:  # 12 usable questions: 2 left for held-out
        source.load()
    assert (err.value.split, err.value.available, err.value.asked) == ("heldout", 2, 3)
    assert err.value.source == "popqa.jsonl" and str(HUB) not in str(err.value)
    digest = hashlib.sha256(popqa.read_bytes()).hexdigest()[:16]
    assert source.describe()["origin"] == [{"name": "popqa.jsonl", "sha256": digest}]


# ----- settings -----


# The settings' override lists (`ood_overrides`, `id_overrides`, `gen_overrides`) are fixtures
# in conftest.py on the same files and sizes; the parameter names the fixture to use.


@pytest.mark.parametrize(
    ("overrides", "sizes", "heldout_kind"),
    [
        ("ood_overrides", (8, 3, 4), "instruction"),
        ("id_overrides", (4, 2, 4), "mcqa"),
        ("gen_overrides", (6, 3, None), "openqa"),
    ],
)
def test_settings_produce_the_expected_loaders(
    tmp_path, tokenizer, compose, request, overrides, sizes, heldout_kind
):
    cfg = compose(request.getfixturevalue(overrides), tmp_path)
    datamodule = build_datamodule(cfg, scorer_from_config(cfg.evaluation), tokenizer)
    datamodule.setup("fit")
    assert len(datamodule.records["train"]) == sizes[0]
    assert len(datamodule.records["heldout"]) == sizes[1]
    assert datamodule.sources["heldout"].kind == heldout_kind
    batch, _, _ = next(iter(datamodule.train_dataloader()))
    for part in ("train", "heldout"):
        labels = batch[part]["labels"]
        assert labels.shape[0] == 2 and (labels != IGNORE_INDEX).any(dim=1).all()
    if sizes[2] is not None:
        datamodule.setup("test")
        assert len(datamodule.records["test"]) == sizes[2]
    train_ids = {r.id for r in datamodule.records["train"]}
    assert not train_ids & {r.id for r in datamodule.records["heldout"]}


def test_id_training_target_is_the_answer_letter(tmp_path, tokenizer, compose, id_overrides):
    # Letter scoring (the embedded model's default is cloze: test_cloze_training.py).
    cfg = compose([*id_overrides, "evaluation.scoring=letter"], tmp_path)
    datamodule = build_datamodule(cfg, scorer_from_config(cfg.evaluation), tokenizer)
    datamodule.setup("fit")
    batch, _, _ = next(iter(datamodule.train_dataloader()))
    labels = batch["train"]["labels"][0]
    target = tokenizer.decode(labels[labels != IGNORE_INDEX])
    assert target[0] in "ABCD" and target[1:] == "<|im_end|>\n"


def test_hub_unavailable_offline_names_dataset_and_remedies(tmp_path, monkeypatch, compose):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    cfg = compose(["setting=ood"], tmp_path)
    source = instantiate(cfg.setting.train)
    with pytest.raises(DataUnavailableError) as err:
        source.load()
    message = str(err.value)
    assert "tatsu-lab/alpaca" in message and "setting.<split>.files=" in message
    assert "HF_HOME" in message and "load_dataset" in message


@pytest.mark.integration
@pytest.mark.parametrize("overrides", ["ood_overrides", "id_overrides"])
def test_base_runs_end_to_end_on_local_hub_schema_files(tmp_path, compose, request, overrides):
    cfg = compose(
        [
            "model=tiny",
            "method=base",
            "trainer.enable_progress_bar=false",
            *request.getfixturevalue(overrides),
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 4
    summary = json.loads((tmp_path / "data_summary.json").read_text())
    assert summary["test"]["n"] == 4
    assert summary["test"]["per_source"]["arc_challenge"]["skipped"] == {
        "3 options": 1,
        "5 options": 1,
    }
