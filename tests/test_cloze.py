"""Option-likelihood (cloze) MCQA scoring: the shared-prompt (KV reuse) path against direct
per-option forwards, the head applied at every continuation token, the temperature fit through
the same path, and end-to-end runs of base and ts (training methods: test_cloze_training.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calm_lightning.data.cloze_batches import encode_question
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.cloze import ClozeScores, score_cloze, score_cloze_separate
from calm_lightning.evaluation.cloze_temperature import (
    fit_cloze_temperature,
    temperature_scales,
    temperature_terms,
)
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment

# Prompts of different lengths (left padding) and options of different token lengths.
QUESTIONS = [
    "What is 2 + 2?",
    "Which planet of the solar system is known as the red planet, and why is it red?",
    "Name a primary colour.",
]
CHOICES = [
    ["4", "five hundred and six", "x", "twenty two thousand"],
    ["Mars", "Jupiter, the giant", "Venus", "no"],
    ["red", "a colour between green and blue", "blue", "yellowish"],
]
TINY = ["model=tiny", "peft.r=4", "trainer.enable_progress_bar=false"]


def _direct(lm, tokenizer, prompt: str, temperature: float = 1.0) -> torch.Tensor:
    """(B, K) summed continuation log-probs, one unpadded HF forward per option."""
    out = torch.zeros(len(QUESTIONS), 4, dtype=torch.float64)
    for q, (question, options) in enumerate(zip(QUESTIONS, CHOICES, strict=True)):
        ctx, conts, _ = encode_question(tokenizer, question, options, prompt)
        for k, cont in enumerate(conts):
            ids = torch.tensor([ctx + cont])
            with torch.no_grad():
                logits = lm(input_ids=ids).logits[0].float() / temperature
            logp = torch.log_softmax(logits, -1)[len(ctx) - 1 : -1]
            out[q, k] = logp.gather(1, torch.tensor(cont)[:, None]).sum().double()
    return out


@pytest.mark.parametrize("prompt", ["chat", "plain"])
def test_shared_prompt_scores_equal_separate_forwards(tiny_loaded, tokenizer, prompt):
    model = CalibratedLM(tiny_loaded.model)
    _, conts, _ = encode_question(tokenizer, QUESTIONS[0], CHOICES[0], prompt)
    assert len({len(c) for c in conts}) > 1  # options of different token lengths
    shared = score_cloze(model, tokenizer, QUESTIONS, CHOICES, prompt)
    direct = _direct(tiny_loaded.model, tokenizer, prompt)
    separate = score_cloze_separate(model, tokenizer, QUESTIONS, CHOICES, prompt)
    assert torch.allclose(shared.loglik, direct, atol=1e-4, rtol=0)
    assert torch.allclose(separate.loglik, direct, atol=1e-4, rtol=0)
    assert shared.n_tokens.tolist()[0] == [len(c) for c in conts]


def test_identity_head_gives_the_base_scores(tiny_loaded, tokenizer):
    base = score_cloze(CalibratedLM(tiny_loaded.model), tokenizer, QUESTIONS, CHOICES)
    vocab = tiny_loaded.model.get_output_embeddings().weight.shape[0]
    headed = CalibratedLM(tiny_loaded.model, LogitAdjustment(vocab, kind="vector"))
    scores = score_cloze(headed, tokenizer, QUESTIONS, CHOICES)
    assert torch.allclose(scores.loglik, base.loglik, atol=1e-5, rtol=0)


def test_scalar_head_is_a_temperature_at_every_token(tiny_loaded, tokenizer):
    vocab = tiny_loaded.model.get_output_embeddings().weight.shape[0]
    head = LogitAdjustment(vocab, kind="scalar")
    with torch.no_grad():
        head.scale.fill_(1 / 2.5)
    scores = score_cloze(CalibratedLM(tiny_loaded.model, head), tokenizer, QUESTIONS, CHOICES)
    # The same scoring with the logits divided by T (not the summed log-likelihoods)...
    divided = score_cloze(
        CalibratedLM(tiny_loaded.model, _Divide(2.5)), tokenizer, QUESTIONS, CHOICES
    )
    assert torch.allclose(scores.loglik, divided.loglik, atol=1e-5, rtol=0)
    # ... and a direct per-option forward at temperature T.
    direct = _direct(tiny_loaded.model, tokenizer, "chat", temperature=2.5)
    assert torch.allclose(scores.loglik, direct, atol=1e-4, rtol=0)
    plain = score_cloze(CalibratedLM(tiny_loaded.model), tokenizer, QUESTIONS, CHOICES)
    assert not torch.allclose(scores.loglik, plain.loglik / 2.5, atol=1e-2)


class _Divide(torch.nn.Module):
    """A stand-in head: the logits divided by T."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        self.temperature = temperature

    def forward(self, logits, token_ids=None):
        return logits.float() / self.temperature


def test_normalisations_and_acc_norm():
    scores = ClozeScores(
        loglik=torch.tensor([[-2.0, -3.0]], dtype=torch.float64),
        n_tokens=torch.tensor([[1.0, 3.0]], dtype=torch.float64),
        n_chars=torch.tensor([[2.0, 10.0]], dtype=torch.float64),
    )
    assert scores.logits("none").tolist() == [[-2.0, -3.0]]
    assert scores.logits("tokens").tolist() == [[-2.0, -1.0]]
    assert scores.logits("chars").tolist() == [[-1.0, -0.3]]
    assert scores.acc_norm_predictions().tolist() == [1]


@pytest.mark.parametrize("normalize", ["none", "chars"])
def test_cloze_temperature_fit_matches_scoring_through_the_head(tiny_loaded, tokenizer, normalize):
    bounds = (0.1, 10.0)
    scales = temperature_scales(bounds)
    model = CalibratedLM(tiny_loaded.model)
    at_one, lse = temperature_terms(model, tokenizer, QUESTIONS, CHOICES, scales)
    labels = torch.tensor([0, 0, 0])
    fit = fit_cloze_temperature(at_one, lse, labels, scales, normalize, bounds)
    vocab = tiny_loaded.model.get_output_embeddings().weight.shape[0]

    def exact_nll(temperature: float) -> float:
        head = LogitAdjustment(vocab, kind="scalar")
        with torch.no_grad():
            head.scale.fill_(1 / temperature)
        scored = score_cloze(CalibratedLM(tiny_loaded.model, head), tokenizer, QUESTIONS, CHOICES)
        logp = torch.log_softmax(scored.logits(normalize), -1)
        return float(-logp[torch.arange(3), labels].mean())

    assert fit.nll_before == pytest.approx(exact_nll(1.0), abs=1e-5)
    assert fit.nll_after == pytest.approx(exact_nll(fit.temperature), abs=1e-4)
    assert fit.nll_after <= fit.nll_before + 1e-9


def test_a_refused_pair_fails_before_any_model_loads(compose, tmp_path, monkeypatch):
    import calm_lightning.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    cfg = compose(["method=cape", "evaluation.scoring=cloze"], tmp_path)
    with pytest.raises(ConfigError, match="cloze"):
        pipeline.run_experiment(cfg)


def test_an_unknown_scoring_is_refused(compose, tmp_path):
    from calm_lightning.pipeline import method_class

    cfg = compose(["method=base", "evaluation.scoring=lettre"], tmp_path)
    with pytest.raises(
        ConfigError, match="evaluation.scoring='lettre' is not one of letter, cloze"
    ):
        method_class(cfg).check_requirements(cfg, {})


@pytest.mark.integration
def test_base_runs_in_cloze_mode_and_reports_acc_norm(compose, tmp_path):
    from calm_lightning.pipeline import run_experiment

    cfg = compose(
        [
            *TINY,
            "method=base",
            "setting=demo",
            "setting.test.limit=8",
            "setting.eval_batch_size=4",
            "evaluation.scoring=cloze",
            "evaluation.cloze.prompt=plain",
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 8 and 0.0 <= metrics["acc_norm"] <= 1.0
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").open()]
    assert all(abs(sum(r["probs"]) - 1) < 1e-5 for r in rows)


@pytest.mark.integration
def test_ts_fits_on_the_cloze_distribution_in_the_id_setting(compose, tmp_path, id_overrides):
    from calm_lightning.pipeline import run_experiment

    cfg = compose([*TINY, "method=ts", *id_overrides, "evaluation.scoring=cloze"], tmp_path)
    metrics = run_experiment(cfg).metrics
    saved = json.loads((tmp_path / "metrics.json").read_text())
    info = saved["posthoc"]
    assert info["fitted_on"] == "mcqa_calibration_half_cloze" and info["n"] == 1
    assert 0.1 <= info["temperature"] <= 10 and info["nll_after"] <= info["nll_before"] + 1e-9
    # No accuracy check: a temperature at every token can reorder options whose
    # continuations differ in length (unlike letter scoring, where the argmax is kept).
    assert np.isfinite(metrics["acc_norm"]) and np.isfinite(metrics["conf_ece"])


@pytest.mark.slow
def test_the_embedded_model_is_above_chance_in_cloze_mode(compose, tmp_path):
    from calm_lightning.pipeline import run_experiment

    cfg = compose(
        [
            "method=base",
            "evaluation.scoring=cloze",
            "evaluation.cloze.prompt=plain",  # 48.8 % measured (chat: 41.2 %)
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 320 and metrics["accuracy"] > 0.40
