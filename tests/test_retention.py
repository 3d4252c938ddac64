"""Retention on lm-eval-harness (evaluation.retention, python -m calm_lightning.retention): the
model adapter against lm-eval's own HF model and against a head applied by hand, local task
files in the hub schemas (tests/fixtures/hub), a tiny CALM run end to end, the saved-run entry,
the errors, and the report's retention tables."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from calm_lightning.errors import ConfigError, DataFormatError, DataUnavailableError
from calm_lightning.evaluation.lm_eval_retention import run_lm_eval
from calm_lightning.evaluation.lm_eval_tasks import RetentionSettings, load_tasks
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "tests" / "fixtures" / "hub"
ALL_TASKS = ("piqa", "winogrande", "arc_easy", "arc_challenge", "hellaswag")
LIMIT = 4


def _settings(tasks=ALL_TASKS, limit=LIMIT, **extra) -> RetentionSettings:
    files = {t: (str(HUB / f"{t}.jsonl"),) for t in tasks}
    return RetentionSettings(tasks=tuple(tasks), data_files=files, limit=limit, **extra)


def _loglikelihoods(raw: dict, task: str) -> list[list[float]]:
    return [[ll for ll, _ in s["filtered_resps"]] for s in raw["samples"][task]]


@pytest.fixture(scope="module")
def fixture_tasks(tmp_path_factory):
    """lm-eval Task objects of the five paper tasks on the local fixture files."""
    return load_tasks(_settings(), tmp_path_factory.mktemp("tasks"))


def test_identity_head_scores_exactly_like_lm_evals_own_hf_model(tiny_loaded, fixture_tasks):
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    reference = evaluate(
        lm=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8),
        task_dict={"tasks": fixture_tasks, "groups": {}, "group_map": {}},
        limit=LIMIT,
        bootstrap_iters=0,
        log_samples=True,
    )
    identity = LogitAdjustment(model.get_output_embeddings().weight.shape[0])  # d = 1, l = 0
    ours = run_lm_eval(CalibratedLM(model, identity), tokenizer, fixture_tasks, _settings())
    for task in ALL_TASKS:
        assert len(ours["samples"][task]) == min(LIMIT, len(reference["samples"][task])) > 0
        assert _loglikelihoods(ours, task) == _loglikelihoods(reference, task), task
        for metric in ("acc,none", "acc_norm,none"):
            assert ours["results"][task].get(metric) == reference["results"][task].get(metric)


def test_a_retention_pass_leaves_the_random_streams_as_they_were():
    """Scoring choices draws nothing, but sampled generation does: whatever runs inside
    `preserved_rng` (as each retention pass does), training afterwards draws the same."""
    import random

    from calm_lightning.evaluation.lm_eval_retention import preserved_rng

    def draws():
        return random.random(), float(np.random.rand()), torch.rand(2).tolist()

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    expected = draws()
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with preserved_rng():
        inside = draws()  # what a sampling task would consume
    assert inside == expected and draws() == expected


def _by_hand(model, tokenizer, head, context: str, continuation: str) -> float:
    """log p(continuation | context) with the head applied to the logits by hand: one forward
    of the whole text, continuation tokens = what it adds to the context's encoding."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:  # lm-eval moves a context's trailing spaces into the continuation
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double()
    adjusted = logits * head.scale.detach().double() + head.bias.detach().double()
    logp = torch.log_softmax(adjusted, dim=-1)
    return float(sum(logp[t - 1, whole[t]] for t in range(start, len(whole))))


def test_a_head_changes_the_scores_exactly_as_applying_it_by_hand(tiny_loaded, fixture_tasks):
    model, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    generator = torch.Generator().manual_seed(0)
    head = LogitAdjustment(model.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        head.scale.copy_(0.5 + torch.rand(head.vocab_size, generator=generator))
        head.bias.copy_(torch.randn(head.vocab_size, generator=generator))
    tasks = {t: fixture_tasks[t] for t in ("piqa", "winogrande", "arc_challenge")}
    settings = _settings(tuple(tasks))
    adjusted = run_lm_eval(CalibratedLM(model, head), tokenizer, tasks, settings)
    plain = run_lm_eval(CalibratedLM(model, None), tokenizer, tasks, settings)
    for task in tasks:
        for sample, plain_lls in zip(
            adjusted["samples"][task], _loglikelihoods(plain, task), strict=True
        ):
            expected = [_by_hand(model, tokenizer, head, *args) for args in sample["arguments"]]
            got = [ll for ll, _ in sample["filtered_resps"]]
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-3)
            # The head moved the scores far beyond that tolerance.
            assert np.abs(np.array(got) - np.array(plain_lls)).max() > 1.0


def test_generate_until_samples_from_the_calibrated_distribution(tiny_loaded):
    from lm_eval.api.instance import Instance

    from calm_lightning.evaluation.lm_eval_model import CalibratedHFLM

    model, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    token = tokenizer(" yes", add_special_tokens=False)["input_ids"][0]
    head = LogitAdjustment(model.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        head.bias.fill_(-1e4)
        head.bias[token] = 0.0  # the head allows one token only
    request = Instance(
        request_type="generate_until",
        doc={},
        arguments=("The primary colours are", {"until": ["\n\n"], "max_gen_toks": 3}),
        idx=0,
    )
    plain = CalibratedHFLM(CalibratedLM(model, None), tokenizer).generate_until([request])
    calibrated = CalibratedHFLM(CalibratedLM(model, head), tokenizer).generate_until([request])
    assert calibrated == [tokenizer.decode([token] * 3)]
    assert plain != calibrated
    assert all(p.requires_grad for p in head.parameters())  # the head stays trainable


def test_local_task_config_keeps_lm_evals_task_and_swaps_the_data(fixture_tasks, tmp_path):
    import yaml

    load_tasks(_settings(("arc_challenge", "winogrande")), tmp_path)
    arc = yaml.safe_load((tmp_path / "arc_challenge.yaml").read_text())
    assert arc["include"].endswith("arc/arc_challenge.yaml") and arc["task"] == "arc_challenge"
    assert arc["dataset_path"] == "json" and arc["dataset_name"] is None
    assert list(arc["dataset_kwargs"]["data_files"]) == ["test"]  # ARC evaluates its test split
    winogrande = fixture_tasks["winogrande"]
    assert list(
        yaml.safe_load((tmp_path / "winogrande.yaml").read_text())["dataset_kwargs"]["data_files"]
    ) == ["validation"]
    # lm-eval's own prompt: the choices are the sentence up to the blank, filled in.
    doc = next(iter(winogrande.eval_docs))
    assert (
        winogrande.doc_to_choice(doc)[0]
        == "The trophy did not fit in the suitcase because the trophy"
    )
    assert len(winogrande.eval_docs) == 6
    piqa = fixture_tasks["piqa"]
    assert piqa.doc_to_text(next(iter(piqa.eval_docs))) == "Question: How do I boil water?\nAnswer:"


def test_option_distribution_conf_ece_matches_an_independent_computation(
    tiny_loaded, fixture_tasks
):
    from calm_lightning.evaluation.lm_eval_retention import evaluate_retention

    tasks = {t: fixture_tasks[t] for t in ("piqa", "arc_easy", "winogrande")}
    settings = _settings(tuple(tasks), limit=None, n_bins=5)
    model = CalibratedLM(tiny_loaded.model, None)
    row = evaluate_retention(model, tiny_loaded.tokenizer, tasks, settings)
    raw = run_lm_eval(model, tiny_loaded.tokenizer, tasks, settings)
    gold = {  # from the fixture files themselves
        "piqa": [json.loads(x)["label"] for x in (HUB / "piqa.jsonl").read_text().splitlines()],
        "winogrande": [
            int(json.loads(x)["answer"]) - 1
            for x in (HUB / "winogrande.jsonl").read_text().splitlines()
        ],
        "arc_easy": [
            (r := json.loads(x))["choices"]["label"].index(r["answerKey"])
            for x in (HUB / "arc_easy.jsonl").read_text().splitlines()
        ],
    }
    for task in tasks:
        lls = _loglikelihoods(raw, task)
        confidence = np.array([np.exp(max(v) - np.logaddexp.reduce(v)) for v in lls])
        correct = np.array([int(np.argmax(v)) == g for v, g in zip(lls, gold[task], strict=True)])
        # conf-ECE with 5 equal-width bins, written out.
        bins = np.minimum((confidence * 5).astype(int), 4)
        ece = sum(
            abs(confidence[bins == b].mean() - correct[bins == b].mean()) * (bins == b).mean()
            for b in range(5)
            if (bins == b).any()
        )
        assert row[task]["n"] == len(gold[task])
        assert row[task]["acc"] == pytest.approx(correct.mean())  # lm-eval's acc, same gold
        assert row[task]["conf_ece"] == pytest.approx(ece, abs=1e-12)
        assert row[task]["mean_confidence"] == pytest.approx(confidence.mean())
    assert "acc_norm" in row["piqa"] and "acc_norm" not in row["winogrande"]


def test_missing_data_names_the_task_the_hub_dataset_and_the_override(tmp_path):
    settings = RetentionSettings(tasks=("piqa",))
    with pytest.raises(DataUnavailableError) as err:
        load_tasks(settings, tmp_path)
    message = str(err.value)
    assert "lm-eval task 'piqa'" in message and "'baber/piqa'" in message
    assert "evaluation.retention.data_files.piqa=[" in message and "goal, sol1, sol2" in message
    with pytest.raises(
        DataUnavailableError, match=r"'allenai/winogrande' \(config 'winogrande_xl'"
    ):
        load_tasks(RetentionSettings(tasks=("winogrande",), option=""), tmp_path)


def test_a_run_without_the_data_stops_before_any_model_loads(compose, tmp_path, monkeypatch):
    import calm_lightning.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    cfg = compose(["model=tiny", "evaluation.retention.tasks=[hellaswag]"], tmp_path)
    with pytest.raises(
        DataUnavailableError, match=r"(?s)'Rowan/hellaswag'.*data_files\.hellaswag=\["
    ):
        pipeline.run_experiment(cfg)


@pytest.mark.integration
def test_a_method_that_does_not_change_the_model_writes_the_base_row_only(compose, tmp_path):
    from calm_lightning.pipeline import run_experiment

    overrides = [
        "model=tiny",
        "method=base",
        "setting.test.limit=4",
        "logger=none",
        "trainer.enable_progress_bar=false",
        "evaluation.retention.tasks=[arc_challenge]",
        f"evaluation.retention.data_files.arc_challenge=[{HUB / 'arc_challenge.jsonl'}]",
        "evaluation.retention.limit=3",
    ]
    run_experiment(compose(overrides, tmp_path))
    rows = json.loads((tmp_path / "retention.json").read_text())["rows"]
    assert list(rows) == ["base"] and rows["base"]["arc_challenge"]["n"] == 3


def test_bad_files_and_names_are_refused_with_the_fix(tmp_path):
    wrong = tmp_path / "piqa.jsonl"
    wrong.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
    with pytest.raises(DataFormatError, match="goal, sol1, sol2"):
        load_tasks(RetentionSettings(tasks=("piqa",), data_files={"piqa": (str(wrong),)}), tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        load_tasks(
            RetentionSettings(tasks=("piqa",), data_files={"piqa": ("nope.jsonl",)}), tmp_path
        )
    with pytest.raises(ConfigError, match="did you mean piqa"):
        load_tasks(RetentionSettings(tasks=("piqaa",)), tmp_path)
    with pytest.raises(ConfigError, match="does not run"):
        unused = RetentionSettings(tasks=("piqa",), data_files={"arc_easy": ("x.jsonl",)})
        load_tasks(unused, tmp_path)


def test_default_config_runs_no_retention_and_overrides_reach_the_settings(compose, tmp_path):
    cfg = compose(["model=tiny"], tmp_path)
    assert not RetentionSettings.from_config(cfg.evaluation.retention).enabled
    cfg = compose(
        [
            "model=tiny",
            "evaluation.retention.tasks=[piqa,hellaswag]",
            f"evaluation.retention.data_files.piqa=[{HUB / 'piqa.jsonl'}]",
            "evaluation.retention.limit=3",
            "evaluation.n_bins=7",
        ],
        tmp_path,
    )
    settings = RetentionSettings.from_config(cfg.evaluation.retention)
    assert settings.tasks == ("piqa", "hellaswag") and settings.limit == 3
    assert settings.data_files == {"piqa": (str(HUB / "piqa.jsonl"),)} and settings.n_bins == 7


@pytest.mark.integration
def test_importing_the_package_and_the_pipeline_does_not_import_lm_eval():
    code = (
        "import sys, calm_lightning, calm_lightning.evaluation.lm_eval_retention;"
        "import calm_lightning.evaluation.lm_eval_tasks;"
        "import calm_lightning.retention;"
        "import calm_lightning.pipeline; print('lm_eval' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


# ----- end to end: a tiny CALM run with retention, then the saved-run entry -----

RETENTION_TASKS = ("piqa", "winogrande")


@pytest.fixture(scope="module")
def calm_run(tiny_calm_run) -> Path:
    """The session's tiny CALM run (conftest.py: retention on piqa and winogrande, limit 4)."""
    return tiny_calm_run


def _samples(path: Path) -> list[list[float]]:
    return [json.loads(line)["loglikelihoods"] for line in path.read_text().splitlines()]


@pytest.mark.integration
def test_a_calm_run_writes_base_and_calm_retention_rows(calm_run, tiny_loaded, capsys):
    payload = json.loads((calm_run / "retention.json").read_text())
    assert set(payload["rows"]) == {"base", "calm"}
    assert payload["num_fewshot"] == 0 and payload["lm_eval_version"] == "0.4.13"
    for row in payload["rows"].values():
        assert set(row) == set(RETENTION_TASKS)
        assert {"acc", "acc_norm", "n", "conf_ece"} <= set(row["piqa"])
        assert row["piqa"]["n"] == row["winogrande"]["n"] == LIMIT
    # The base row is the untouched model: lm-eval's own HF model on a fresh tiny model.
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM

    tasks = load_tasks(_settings(RETENTION_TASKS), calm_run / "check")
    fresh = evaluate(
        lm=HFLM(pretrained=tiny_loaded.model, tokenizer=tiny_loaded.tokenizer, batch_size=8),
        task_dict={"tasks": tasks, "groups": {}, "group_map": {}},
        limit=LIMIT,
        bootstrap_iters=0,
        log_samples=True,
    )
    for task in RETENTION_TASKS:
        base = _samples(calm_run / "retention" / "base" / f"{task}.jsonl")
        calm = _samples(calm_run / "retention" / "calm" / f"{task}.jsonl")
        np.testing.assert_allclose(base, _loglikelihoods(fresh, task), rtol=1e-6, atol=1e-4)
        assert np.abs(np.array(calm) - np.array(base)).max() > 1e-2  # calibration moved them
    timings = json.loads((calm_run / "metrics.json").read_text())["timings"]
    assert timings["retention_base_s"] > 0 and timings["retention_s"] > 0


@pytest.mark.integration
def test_the_saved_run_entry_reproduces_the_runs_rows(calm_run, tmp_path, capsys):
    from calm_lightning.retention import main

    out = tmp_path / "again"
    args = [
        f"run_dir={calm_run}",
        f"out={out}",
        f"tasks=[{','.join(RETENTION_TASKS)}]",  # the run's own block would do; said explicitly
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "base" in printed and "calm" in printed and "winogrande" in printed
    again = json.loads((out / "retention.json").read_text())
    original = json.loads((calm_run / "retention.json").read_text())
    assert again["source"] == "saved run" and again["data_files"] == original["data_files"]
    for name in ("base", "calm"):
        for task in RETENTION_TASKS:
            np.testing.assert_allclose(
                _samples(out / "retention" / name / f"{task}.jsonl"),
                _samples(calm_run / "retention" / name / f"{task}.jsonl"),
                rtol=1e-6,
                atol=1e-4,
            )
            for metric in ("acc", "acc_norm", "n"):
                assert again["rows"][name][task].get(metric) == original["rows"][name][task].get(
                    metric
                )
    # A second time into the same folder is refused, with the fix.
    assert main(args) == 1
    assert "overwrite=true" in capsys.readouterr().err


@pytest.mark.integration
def test_the_saved_run_entry_refuses_bad_arguments(calm_run, capsys):
    from calm_lightning.retention import main

    assert main([f"run_dir={calm_run}", "task=[piqa]"]) == 1
    assert "unknown argument 'task=[piqa]'" in capsys.readouterr().err
    assert main(["tasks=[piqa]"]) == 1
    assert "missing run_dir=" in capsys.readouterr().err


@pytest.mark.integration
def test_the_report_has_a_retention_table(calm_run, tmp_path):
    from calm_lightning.reporting.collect import collect_runs
    from calm_lightning.reporting.render import write_report

    write_report(collect_runs([calm_run]), tmp_path)
    report = (tmp_path / "report.md").read_text()
    rows = json.loads((calm_run / "retention.json").read_text())["rows"]
    assert "## Retention" in report and "| method | piqa | winogrande | seeds |" in report
    section = report.split("## Retention", 1)[1].splitlines()
    calm_line = next(line for line in section if line.startswith("| calm |"))
    base_line = next(line for line in section if line.startswith("| base |"))
    assert f"{100 * rows['base']['winogrande']['acc']:.2f}" in base_line
    assert f"{100 * rows['calm']['piqa']['acc']:.2f}" in calm_line
    assert (tmp_path / "retention.csv").is_file()


def test_retention_rows_average_over_seeds(tmp_path):
    from calm_lightning.reporting.collect import Run
    from calm_lightning.reporting.retention_table import retention_markdown, retention_rows
    from calm_lightning.reporting.selection import Choice

    def run(seed, base_acc, calm_acc):
        r = Run(tmp_path / str(seed), "m", "calm", "s", seed, {})
        r.retention = {
            "base": {"piqa": {"acc": base_acc, "conf_ece": 0.1, "n": 10}},
            "calm": {"piqa": {"acc": calm_acc, "conf_ece": 0.05 * seed, "n": 10}},
        }
        return r

    runs = [run(1, 0.6, 0.5), run(2, 0.6, 0.7)]
    choice = Choice("m", "s", "calm", {}, {}, {}, 2, runs, True)
    rows = {r.method: r for r in retention_rows([choice], runs)}
    assert rows["calm"].mean_std("piqa", "acc") == pytest.approx((0.6, 0.1, 2))
    assert rows["base"].mean_std("piqa", "acc") == pytest.approx((0.6, 0.0, 2))
    text = retention_markdown(list(rows.values()))
    assert "| calm | 60.00 ± 10.00 | 2 |" in text and "| calm | 0.0750 ± 0.0250 | 2 |" in text


@pytest.mark.slow
def test_the_embedded_model_beats_chance_on_the_piqa_fixture(compose, tmp_path):
    """SmolLM2-135M-Instruct, lm-eval's PIQA task zero-shot on the 40 fixture items."""
    from calm_lightning.evaluation.lm_eval_retention import evaluate_retention
    from calm_lightning.models.loading import load_language_model

    loaded = load_language_model(compose([], tmp_path).model)
    settings = _settings(("piqa",), limit=None)
    tasks = load_tasks(settings, tmp_path)
    row = evaluate_retention(CalibratedLM(loaded.model, None), loaded.tokenizer, tasks, settings)
    assert row["piqa"]["n"] == 40
    # 27 of 40 or more: P <= 0.02 under guessing (binomial, p = 1/2).
    assert row["piqa"]["acc"] >= 27 / 40, row
