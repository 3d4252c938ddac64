"""The per-token post-hoc baselines (methods/per_token.py): cc, cc_ts, bc, vs, oracle, each
against a computation made here (numpy on the stored option probabilities, a hand-built
vocabulary for vector scaling, the clean model for the oracle)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from calm_lightning.calibrators.vector_scaling import (
    TokenRows,
    fit_vector_scaling,
    letter_rows,
    nll,
    option_logits,
)
from calm_lightning.errors import ConfigError
from calm_lightning.pipeline import run_experiment
from calm_lightning.runtime.run_record import BASE_DIR, read_predictions

RUN = [
    "model=tiny",
    "model.tiny.embedding_scale=1.0",  # no near-0 probabilities: stored rows keep 6 decimals
    "setting=demo_id",
    "setting.test.limit=8",
    "setting.heldout.limit=8",
    "setting.eval_batch_size=4",
    "evaluation.scoring=cloze",
    "trainer.enable_progress_bar=false",
    "logger=none",
]


def _probs(folder) -> tuple[list[str], np.ndarray, np.ndarray]:
    rows = read_predictions(folder)
    return (
        [r["id"] for r in rows],
        np.array([r["probs"] for r in rows]),
        np.array([r["label"] for r in rows]),
    )


def _run(compose, tmp_path, *overrides):
    cfg = compose([*RUN, *overrides], tmp_path)
    result = run_experiment(cfg)
    return result, json.loads((tmp_path / "metrics.json").read_text())


# ----- vector scaling's objective and fit, without a model -----


def _cloze_like(seed=0, n=60, k=3, n_ids=6, extra=5):
    """Random positions over a vocabulary of O (n_ids) + `extra` other ids: each option has 1
    to 3 positions whose target is in O. Returns the rows, the full (P, V) logits and labels."""
    g = torch.Generator().manual_seed(seed)
    owners, lengths = [], []
    for row in range(n * k):
        m = int(torch.randint(1, 4, (1,), generator=g))
        owners += [row] * m
        lengths.append(m)
    p = len(owners)
    full = torch.randn(p, n_ids + extra, generator=g, dtype=torch.float64) * 2
    rows = TokenRows(
        z=full[:, :n_ids].clone(),
        rest=torch.logsumexp(full[:, n_ids:], -1),
        target=torch.randint(0, n_ids, (p,), generator=g),
        owner=torch.tensor(owners),
        lengths=torch.ones(n, k, dtype=torch.float64),
    )
    labels = torch.randint(0, k, (n,), generator=g)
    return rows, full, labels


def test_vs_option_logits_are_the_full_vocabulary_log_softmax_summed():
    rows, full, _ = _cloze_like()
    d = torch.linspace(0.5, 1.5, 6, dtype=torch.float64)
    l_ = torch.linspace(-1, 1, 6, dtype=torch.float64)
    # by hand: the head on O, identity elsewhere, log-softmax over the whole vocabulary
    adjusted = full.clone()
    adjusted[:, :6] = full[:, :6] * d + l_
    logp = torch.log_softmax(adjusted, -1).gather(1, rows.target[:, None]).squeeze(1)
    expected = torch.zeros(rows.lengths.numel(), dtype=torch.float64)
    for score, owner in zip(logp, rows.owner, strict=True):
        expected[owner] += score
    torch.testing.assert_close(option_logits(rows, d, l_).flatten(), expected)


def test_vs_fit_lowers_the_nll_and_a_huge_penalty_keeps_the_identity():
    rows, _, labels = _cloze_like(seed=1)
    fit = fit_vector_scaling(rows, labels, l2=1e-4)
    assert fit.nll_after < fit.nll_before - 1e-3
    ones = torch.ones(6, dtype=torch.float64)
    zeros = torch.zeros(6, dtype=torch.float64)
    assert fit.nll_before == pytest.approx(float(nll(rows, labels, ones, zeros)))
    stiff = fit_vector_scaling(rows, labels, l2=1e6)
    torch.testing.assert_close(stiff.scale, ones, atol=1e-5, rtol=0)
    torch.testing.assert_close(stiff.bias, zeros, atol=1e-5, rtol=0)


def test_vs_on_letters_recovers_the_generating_scale_and_bias():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(6000, 4, generator=g, dtype=torch.float64) * 2
    d_true = torch.tensor([0.5, 0.8, 1.2, 0.6], dtype=torch.float64)
    l_true = torch.tensor([0.4, -0.3, 0.0, 0.7], dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(z * d_true + l_true, -1), 1, generator=g).squeeze(1)
    fit = fit_vector_scaling(letter_rows(z), labels, l2=0.0)
    torch.testing.assert_close(fit.scale, d_true, atol=0.08, rtol=0)
    # a common shift of every letter's bias changes nothing: compare centred biases
    torch.testing.assert_close(
        fit.bias - fit.bias.mean(), l_true - l_true.mean(), atol=0.08, rtol=0
    )


# ----- the methods through the pipeline (tiny model) -----


def test_bc_divides_by_the_mean_test_probabilities(tmp_path, compose):
    _, saved = _run(compose, tmp_path, "method=bc")
    ids, base, _ = _probs(tmp_path / BASE_DIR)
    bc_ids, bc, _ = _probs(tmp_path)
    assert ids == bc_ids
    prior = base.mean(0)
    expected = base / prior
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(bc, expected, atol=2e-5)
    np.testing.assert_allclose(saved["posthoc"]["prior"], prior, atol=2e-5)
    assert saved["posthoc"]["fitted_on"] == "test_unlabeled" and saved["posthoc"]["n"] == 8


def test_cc_divides_by_the_content_free_probabilities(tmp_path, compose):
    from calm_lightning.data.sources import EmbeddedDemoSource
    from calm_lightning.evaluation.cloze import score_cloze
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model

    # per-token means: option probabilities far from 0, which the stored 6 decimals keep
    _, saved = _run(compose, tmp_path, "method=cc", "evaluation.cloze.normalize=tokens")
    ids, base, _ = _probs(tmp_path / BASE_DIR)
    _, cc, _ = _probs(tmp_path)
    records = EmbeddedDemoSource("mcqa", "test", limit=8).load()
    assert [r.id for r in records] == ids
    cfg = compose(RUN, tmp_path / "unused")
    loaded = load_language_model(cfg.model)
    model = CalibratedLM(loaded.model.eval())
    choices = [list(r.choices) for r in records]
    p_cf = np.mean(
        [
            torch.softmax(
                score_cloze(model, loaded.tokenizer, [text] * 8, choices).logits("tokens"), -1
            ).numpy()
            for text in ("N/A", "", "[MASK]")
        ],
        axis=0,
    )
    expected = base / p_cf
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(cc, expected, atol=1e-4)
    np.testing.assert_allclose(saved["posthoc"]["p_cf_mean"], p_cf.mean(0), atol=1e-6)
    assert saved["posthoc"]["content_free"] == ["N/A", "", "[MASK]"]


def test_bc_under_letter_scoring_divides_by_the_mean_test_probabilities(tmp_path, compose):
    _run(compose, tmp_path, "method=bc", "evaluation.scoring=letter")
    _, base, _ = _probs(tmp_path / BASE_DIR)
    _, bc, _ = _probs(tmp_path)
    expected = base / base.mean(0)
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(bc, expected, atol=2e-5)


def test_cc_under_letter_scoring_divides_by_one_question_free_letter_prior(tmp_path, compose):
    """Letter scoring: the content-free input replaces the question and every option text, so
    its prompt, and p_cf, is the same for every question with the same number of options:
    the correction is one prior over the letters, p / p_cf renormalised."""
    _, saved = _run(compose, tmp_path, "method=cc", "evaluation.scoring=letter")
    _, base, _ = _probs(tmp_path / BASE_DIR)
    _, cc, _ = _probs(tmp_path)
    p_cf = np.array(saved["posthoc"]["p_cf_mean"])
    assert p_cf.sum() == pytest.approx(1.0, abs=1e-6)
    assert np.abs(p_cf - 1 / len(p_cf)).max() > 1e-4  # the letters are not equally likely
    expected = base / p_cf
    expected /= expected.sum(1, keepdims=True)
    np.testing.assert_allclose(cc, expected, atol=5e-5)


def test_cc_ts_fits_a_temperature_on_the_corrected_calibration_logits(tmp_path, compose):
    _, saved = _run(compose, tmp_path, "method=cc_ts")
    info = saved["posthoc"]
    assert info["fitted_on"] == "mcqa_calibration_half_corrected" and info["n"] == 4
    assert 0.1 <= info["temperature"] <= 10 and info["nll_after"] <= info["nll_before"] + 1e-9


@pytest.mark.parametrize("scoring", ["cloze", "letter"])
def test_vs_fits_the_option_tokens_on_the_calibration_split(tmp_path, compose, scoring):
    result, saved = _run(
        compose, tmp_path, "method=vs", f"evaluation.scoring={scoring}", "method.module.l2=0.001"
    )
    info = saved["posthoc"]
    assert info["n"] == 4 and info["nll_after"] < info["nll_before"]
    head = info["head"]
    assert len(head["token_ids"]) == info["n_tokens"] == len(head["scale"]) == len(head["bias"])
    if scoring == "letter":
        assert head["token_ids"] == saved["option_tokens"]["ids"]
    assert (tmp_path / "calibration" / "logit_adjustment.safetensors").is_file()
    assert np.isfinite(result.metrics["nll"])


def test_oracle_gives_back_the_clean_base(tmp_path, compose):
    clean, _ = _run(compose, tmp_path / "clean", "method=base")
    distorted = ["model.logit_scale=4.0", "model.logit_distortion={bias: 3.0, seed: 1}"]
    oracle, saved = _run(compose, tmp_path / "oracle", "method=oracle", *distorted)
    assert saved["posthoc"]["d"] == 0.25 and saved["posthoc"]["l_on_s_plus"] == -0.75
    _, clean_probs, _ = _probs(tmp_path / "clean")
    _, base_probs, _ = _probs(tmp_path / "oracle" / BASE_DIR)
    _, oracle_probs, _ = _probs(tmp_path / "oracle")
    assert np.abs(base_probs - clean_probs).max() > 0.05  # the distortion did something
    np.testing.assert_allclose(oracle_probs, clean_probs, atol=2e-6)
    for metric in ("accuracy", "nll", "brier"):
        assert oracle.metrics[metric] == pytest.approx(clean.metrics[metric], abs=1e-6)


def test_baselines_that_read_mcqa_held_out_data_refuse_instructions(tmp_path, compose):
    import calm_lightning.pipeline as pipeline

    for method in ("vs", "cc_ts"):
        cfg = compose(["model=tiny", "setting=demo", f"method={method}"], tmp_path)
        original = pipeline.load_language_model
        pipeline.load_language_model = lambda *_: pytest.fail("model loaded")
        try:
            with pytest.raises(ConfigError, match=rf"method={method} reads the heldout split"):
                run_experiment(cfg)
        finally:
            pipeline.load_language_model = original
