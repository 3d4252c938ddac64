"""The Dual-Align paper's post-hoc family end to end on a tiny PLM / PoLM pair (PoLM = the PLM
with every logit multiplied by 4, so the right temperature is 4 when both read the same input:
`reference_prompt=chat`), plus the CAPE, IC and elicitation pieces checked against hand
computations."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from calm_lightning.data.fit_split import FitTestSplit
from calm_lightning.data.records import MCQARecord
from calm_lightning.data.sources import EmbeddedDemoSource
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.verbalized import parse_answer_letter, parse_confidence
from calm_lightning.methods.base import stated_answer_probs
from calm_lightning.methods.prompting import permutation_average
from calm_lightning.pipeline import run_experiment

K = 4.0
HUB = Path(__file__).parent / "fixtures" / "hub"


def _pair(method: str, tmp_path: Path, extra=()) -> list[str]:
    return [
        "model=tiny",
        f"model.logit_scale={K}",
        "reference_model=tiny_plm",
        f"method={method}",
        "setting=demo_posthoc",
        "setting.test.source.limit=120",
        "trainer.enable_progress_bar=false",
        "logger=none",
        *extra,
    ]


def _with_cache(tmp_path: Path) -> list[str]:
    return [f"method.module.cache_dir={tmp_path / 'cache'}"]


# The PLM reads the PoLM's own prompt text: only then is the scaled PoLM exactly 4 x the PLM.
# It is the default (docs/posthoc.md: the known-temperature measurement behind it).
SAME_INPUT = "method.module.reference_prompt=chat"


@pytest.mark.integration
def test_daca_and_dual_align_recover_the_known_temperature(tmp_path, compose):
    results = {}
    for method in ("daca", "dual_align"):
        out = tmp_path / method
        cfg = compose(_pair(method, tmp_path, _with_cache(tmp_path)), out)  # the defaults
        metrics = run_experiment(cfg).metrics
        payload = json.loads((out / "metrics.json").read_text())
        results[method] = payload
        fit = payload["posthoc"]
        assert fit["reference_prompt"] == "chat"
        assert fit["temperature"] == pytest.approx(K, rel=0.03)
        assert fit["n"] == 36 and metrics["n"] == 84  # 30 % / 70 % of 120
        assert fit["agreement_rate"] == 1.0  # a scaled model never changes its answer
        # Accuracy unchanged, calibration metrics reported.
        assert metrics["accuracy"] == payload["comparison"]["base"]["accuracy"]
        for key in ("conf_ece", "mce", "ace", "brier"):
            assert key in metrics
    # The second method reuses the lens pass of the first (same models, data, options).
    assert results["daca"]["posthoc"]["lens_cache"] == "miss"
    assert results["dual_align"]["posthoc"]["lens_cache"] == "hit"
    # With two layers l* is always layer 2 and w = max(d_2 - d_1, 0) / ln 2: the tiny pair's
    # divergence can fall from layer 1 to 2 on every sample, making w = 0 (pure KL).
    assert 0 <= results["dual_align"]["posthoc"]["mean_weight"] < 1


@pytest.mark.integration
def test_base_and_posthoc_methods_test_the_same_questions(tmp_path, compose):
    ids = {}
    for method in ("base", "ic"):
        out = tmp_path / method
        run_experiment(compose(_pair(method, tmp_path), out))
        ids[method] = [json.loads(x)["id"] for x in (out / "predictions.jsonl").open()]
    assert ids["base"] == ids["ic"] and len(ids["base"]) == 84
    pool = EmbeddedDemoSource("mcqa", "test", limit=120)
    fit = {r.id for r in FitTestSplit(pool, "fit", 0.3, seed=0).load()}
    assert fit.isdisjoint(ids["base"]) and len(fit) + len(ids["base"]) == 120


def test_reference_methods_refuse_without_a_reference_model(tmp_path, monkeypatch, compose):
    import calm_lightning.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("loaded"))
    overrides = [o for o in _pair("dual_align", tmp_path) if not o.startswith("reference_")]
    with pytest.raises(ConfigError, match="needs reference_model=.*llama31_8b"):
        run_experiment(compose(overrides, tmp_path))


@pytest.mark.integration
def test_option_token_disagreement_fails_clearly(tmp_path, monkeypatch, compose):
    import calm_lightning.methods.reference_temperature as reference
    from calm_lightning.evaluation.mcqa import OptionTokens

    monkeypatch.setattr(
        reference,
        "option_token_candidates",
        lambda tok, n, prompt=None: {
            s: OptionTokens(s, (1, 2, 3, 4), "ABCD") for s in ("bare", "space")
        },
    )
    cfg = compose(_pair("daca", tmp_path, ["method.module.use_cache=false"]), tmp_path)
    with pytest.raises(ConfigError, match="disagree on the option tokens"):
        run_experiment(cfg)


@pytest.mark.integration
def test_dual_align_on_mmlu_fixture_files(tmp_path, compose):
    overrides = [
        o
        for o in _pair("dual_align", tmp_path, [*_with_cache(tmp_path), SAME_INPUT])
        if "setting" not in o
    ]
    overrides += [
        "setting=posthoc_mmlu",
        f"setting.test.source.sources.mmlu.files=[{HUB / 'mmlu.jsonl'}]",
        "setting.test.source.sizes.test=6",  # the 7th row has no 4 options and is dropped
        "setting.test.fit_fraction=0.5",
        "setting.eval_batch_size=4",
    ]
    metrics = run_experiment(compose(overrides, tmp_path)).metrics
    fit = json.loads((tmp_path / "metrics.json").read_text())["posthoc"]
    assert metrics["n"] == 3 and fit["n"] == 3
    assert fit["temperature"] == pytest.approx(K, rel=0.05)


def _record_plm_inputs(monkeypatch, quantized: bool = False) -> list[list[int]]:
    """Every token-id row the PLM reads in the lens pass (padding removed); optionally the PLM
    is reported as loaded in 4-bit."""
    import calm_lightning.methods.reference_temperature as reference
    import calm_lightning.models.loading as loading

    seen, plm = [], []
    load, lens = loading.load_language_model, reference.lens_option_logits

    def load_plm(cfg):
        loaded = load(cfg)
        loaded.quantized = quantized
        plm.append(loaded.model)
        return loaded

    def recording_lens(lm, input_ids, attention_mask, *args):
        if plm and lm is plm[-1]:
            rows = zip(input_ids, attention_mask, strict=True)
            seen.extend(row[mask.bool()].tolist() for row, mask in rows)
        return lens(lm, input_ids, attention_mask, *args)

    monkeypatch.setattr(loading, "load_language_model", load_plm)
    monkeypatch.setattr(reference, "lens_option_logits", recording_lens)
    return seen


@pytest.mark.integration
def test_reference_prompt_decides_what_the_plm_reads(
    tmp_path, monkeypatch, compose, caplog, tokenizer
):
    from calm_lightning.data.prompts import mcqa_user_text, render_prompt

    seen = _record_plm_inputs(monkeypatch, quantized=True)
    limit = ["setting.test.source.limit=20", *_with_cache(tmp_path)]
    pool = EmbeddedDemoSource("mcqa", "test", limit=20)
    fit = FitTestSplit(pool, "fit", 0.3, seed=0).load()
    statuses, inputs = {}, {}
    for prompt in ("chat", "plain"):
        seen.clear()
        overrides = _pair("daca", tmp_path, [*limit, f"method.module.reference_prompt={prompt}"])
        with caplog.at_level("WARNING"):
            run_experiment(compose(overrides, tmp_path / prompt))
        payload = json.loads((tmp_path / prompt / "metrics.json").read_text())
        statuses[prompt] = payload["posthoc"]["lens_cache"]
        assert payload["posthoc"]["reference_prompt"] == prompt
        inputs[prompt] = list(seen)
    tok = tokenizer  # the tiny PLM's (and PoLM's) tokenizer
    # chat: the PoLM's rendered template, re-tokenized without added special tokens.
    chat = [
        tok(render_prompt(tok, mcqa_user_text(r)), add_special_tokens=False)["input_ids"]
        for r in fit
    ]
    # plain: no template, the question block then "Answer:", with the PLM's own special tokens.
    plain = [tok(f"{mcqa_user_text(r)}\nAnswer:")["input_ids"] for r in fit]
    assert inputs["chat"] == chat and inputs["plain"] == plain and chat != plain
    assert not any("<|im_start|>" in tok.decode(ids) for ids in plain)
    # The prompt is part of the lens cache key: the second run cannot reuse the first's pass.
    assert statuses == {"chat": "miss", "plain": "miss"}
    assert "not comparable" in caplog.text and "reference_model.quantization=none" in caplog.text


def test_a_quantized_polm_warns_that_numbers_are_not_comparable(tiny_loaded, caplog):
    from dataclasses import replace

    from calm_lightning.methods.reference_temperature import DualAlign

    with caplog.at_level("WARNING"):
        DualAlign.build_model(replace(tiny_loaded, quantized=False), {"method": "none"})
    assert "not comparable" not in caplog.text
    with caplog.at_level("WARNING"):
        DualAlign.build_model(replace(tiny_loaded, quantized=True), {"method": "none"})
    assert "PoLM" in caplog.text and "model.quantization=none" in caplog.text


@pytest.mark.integration
@pytest.mark.parametrize("method", ["ic", "cape", "elicitation"])
def test_confidence_methods_run_end_to_end(tmp_path, method, compose):
    extra = ["setting.test.source.limit=20"]
    if method == "elicitation":
        extra.append("method.module.max_new_tokens=6")  # a random model never stops early
    overrides = _pair(method, tmp_path, extra)
    metrics = run_experiment(compose(overrides, tmp_path)).metrics
    rows = [json.loads(x) for x in (tmp_path / "predictions.jsonl").open()]
    assert metrics["n"] == len(rows) == 14
    probs = np.array([r["probs"] for r in rows])
    np.testing.assert_allclose(probs.sum(1), 1.0, atol=1e-6)
    acc = np.mean([r["prediction"] == r["label"] for r in rows])
    assert metrics["accuracy"] == pytest.approx(acc)
    for key in ("conf_ece", "mce", "ace", "brier"):
        assert np.isfinite(metrics[key])
    if method == "ic":  # with 2 layers and the final left out, confidence is 0 or 1
        assert {r["confidence"] for r in rows} <= {0.0, 1.0}
    if method == "elicitation":  # a random model writes no parsable confidence
        failures = metrics["confidence_parse_failures"]
        assert 0 <= failures <= 14 and "letter_parse_failures" in metrics


def test_cape_is_invariant_to_the_order_of_the_options(tiny_loaded):
    from calm_lightning.data.collate import MCQACollator
    from calm_lightning.evaluation.mcqa import option_token_candidates, score_options
    from calm_lightning.models.calibrated_lm import CalibratedLM

    model, tokenizer = CalibratedLM(tiny_loaded.model), tiny_loaded.tokenizer
    tokens = option_token_candidates(tokenizer)["bare"]
    collate = MCQACollator(tokenizer)

    def score(records):
        return torch.softmax(score_options(model, collate(records), tokens).double(), -1)

    record = MCQARecord("q", "Which is a fruit?", ("stone", "apple", "river", "cloud"), 1)
    order = (2, 0, 3, 1)  # shown slot j holds original option order[j]
    shuffled = MCQARecord("q", record.question, tuple(record.choices[j] for j in order), 3)
    with torch.no_grad():
        plain = score([record])[0]
        base = permutation_average([record], score, "all")[0]
        other = permutation_average([shuffled], score, "all")[0]
        cyclic = permutation_average([record], score, "cyclic")[0]
    torch.testing.assert_close(other, base[list(order)])
    assert not torch.allclose(plain, score([shuffled])[0][[order.index(j) for j in range(4)]])
    assert cyclic.sum().item() == pytest.approx(1.0)


def test_stated_answer_probabilities():
    probs = stated_answer_probs(torch.tensor([0.7, 0.1]), torch.tensor([2, 0]), 4)
    torch.testing.assert_close(
        probs,
        torch.tensor([[0.1, 0.1, 0.7, 0.1], [0.1, 0.3, 0.3, 0.3]], dtype=torch.float64),
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: B\nConfidence: 80%", 0.8),
        ("Answer: C, Confidence: 0.8", 0.8),
        ("I am eighty percent sure.", 0.8),
        ("confidence ninety-five", 0.95),
        ("Confidence: 100 %", 1.0),
        ("Confidence: 7", 0.07),
        ("Confidence: one hundred percent", 1.0),
        ("Confidence: high", 0.8),
        ("Confidence: very low", 0.05),
        ("Answer: A\nConfidence: 250%", None),
        ("the answer is A", None),
        ("@@ ## !!", None),
        ("", None),
    ],
)
def test_confidence_parser(text, expected):
    value = parse_confidence(text)
    assert value == (pytest.approx(expected) if expected is not None else None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Answer: B\nConfidence: 80%", 1),
        ("the answer is (c)", 2),
        ("D. because it is", 3),
        ("I think A", 0),
        ("no idea", None),
    ],
)
def test_answer_letter_parser(text, expected):
    assert parse_answer_letter(text, "ABCD") == expected


@pytest.mark.integration
def test_ts_oracle_fits_on_the_whole_fit_part(tmp_path, compose):
    overrides = [o for o in _pair("ts", tmp_path) if not o.startswith("reference_")]
    metrics = run_experiment(compose(overrides, tmp_path)).metrics
    fit = json.loads((tmp_path / "metrics.json").read_text())["posthoc"]
    assert fit["n"] == 36 and metrics["n"] == 84  # method_setting/ts_demo_posthoc.yaml


@pytest.mark.slow
def test_dual_align_with_the_embedded_model_as_polm(tmp_path, compose):
    """Any pair works: the embedded SmolLM2 as PoLM against a 30-layer tiny PLM that shares its
    tokenizer (a structural check; the temperature itself means nothing here)."""
    overrides = [
        "model=smollm2",
        "reference_model=tiny_plm",
        "reference_model.tiny.num_layers=30",  # SmolLM2-135M's depth
        "method=dual_align",
        "evaluation.scoring=letter",  # Dual-Align reads the option letters' lens
        "setting=demo_posthoc",
        "setting.test.source.limit=40",
        "trainer.enable_progress_bar=false",
        "logger=none",
        *_with_cache(tmp_path),
    ]
    metrics = run_experiment(compose(overrides, tmp_path)).metrics
    payload = json.loads((tmp_path / "metrics.json").read_text())
    fit = payload["posthoc"]
    assert fit["n"] == 12 and fit["n_layers"] == 30 and np.isfinite(fit["temperature"])
    assert metrics["accuracy"] == payload["comparison"]["base"]["accuracy"]


@pytest.mark.integration
def test_posthoc_sweep_and_report_give_mean_and_std_over_seeds(tmp_path):
    """The posthoc_reference grid (cut to two methods x two seeds) through Hydra's launcher,
    then the reporter: one row per method, averaged over the seeds, with MCE / ACE / Brier."""
    import os
    import subprocess
    import sys

    from calm_lightning.report import main as report_main

    args = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        "+sweep=posthoc_reference",
        "method=base,daca",  # the command line narrows the sweep file's grid
        "seed=0,1",
        "model=tiny",
        f"model.logit_scale={K}",
        "reference_model=tiny_plm",
        "setting=demo_posthoc",
        "setting.test.source.limit=20",
        "trainer.enable_progress_bar=false",
        "logger=none",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", CALM_LIGHTNING_CACHE=str(tmp_path / "cache"))
    done = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = [p for p in (tmp_path / "sweep").iterdir() if (p / "metrics.json").is_file()]
    assert len(jobs) == 4
    assert report_main([str(tmp_path / "sweep")]) == 0
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "| MCE | ACE | AvgCE | Brier |" in report
    table = report.split("\n### ", 1)[1].split("\n\n", 2)[1]  # the first table, not the paired
    rows = [line for line in table.splitlines() if line.startswith(("| base", "| daca"))]
    assert len(rows) == 2 and all(row.endswith("| 2 |") for row in rows)


def test_posthoc_medmcqa_splits_the_validation_pool_30_70(tmp_path, compose):
    from hydra.utils import instantiate

    cfg = compose(
        [
            "setting=posthoc_medmcqa",
            f"setting.test.source.sources.medmcqa.files=[{HUB / 'medmcqa.jsonl'}]",
            "seed=1",
        ],
        tmp_path,
    )
    fit = instantiate(cfg.setting.heldout).load()
    test = instantiate(cfg.setting.test).load()
    pool = instantiate(cfg.setting.test.source).load()
    assert {r.source for r in pool} == {"medmcqa"}
    assert len(fit) == round(0.3 * len(pool)) and len(fit) + len(test) == len(pool)
    assert {r.id for r in fit}.isdisjoint(r.id for r in test)
    with pytest.raises(ConfigError, match="strictly between 0 and 1"):
        FitTestSplit(pool, "test", fit_fraction=1.0)
