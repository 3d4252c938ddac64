"""Baselines: temperature scaling, label smoothing, regularization, Iterate and CFT, checked
against hand computations and run end to end through the shared pipeline."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from calm_lightning.calibrators.temperature import fit_temperature
from calm_lightning.data.collate import IGNORE_INDEX
from calm_lightning.errors import ConfigError
from calm_lightning.methods.iterate import Iterate
from calm_lightning.methods.single_level import (
    Regularization,
    bin_statistics,
    cft_calibration_loss,
    cft_targets,
    smoothed_targets,
    soft_cross_entropy,
)
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.pipeline import run_experiment

# ----- temperature scaling -----


def _tempered_sample(temperature: float, n: int = 20000, k: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, generator=generator, dtype=torch.float64) * 3
    labels = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=generator)
    return logits, labels.squeeze(1)


@pytest.mark.parametrize("true_t", [0.5, 2.0, 4.0])
def test_temperature_recovers_the_generating_temperature(true_t):
    logits, labels = _tempered_sample(true_t)
    fit = fit_temperature(logits, labels)
    assert fit.temperature == pytest.approx(true_t, rel=0.08)
    assert fit.nll_after <= fit.nll_before and not fit.at_bound


def test_temperature_matches_a_brute_force_grid():
    logits, labels = _tempered_sample(1.7, n=3000, seed=1)
    grid = np.linspace(0.1, 10, 9901)
    z, y = logits.numpy(), labels.numpy()
    nll = []
    for part in np.array_split(grid, 40):  # vectorised over temperatures, in slices
        scaled = z[None] / part[:, None, None]
        lse = np.log(np.exp(scaled - scaled.max(-1, keepdims=True)).sum(-1)) + scaled.max(-1)
        nll.extend((lse - scaled[:, np.arange(len(y)), y]).mean(-1))
    best = grid[int(np.argmin(nll))]
    assert fit_temperature(logits, labels).temperature == pytest.approx(best, abs=2e-3)


def test_temperature_on_a_bound_is_flagged(caplog):
    logits, labels = _tempered_sample(50.0, n=4000)  # near-uniform labels: T wants to exceed 10
    fit = fit_temperature(logits, labels)
    assert fit.at_bound and fit.temperature == pytest.approx(10.0, abs=1e-2)
    assert "search bound" in caplog.text


# ----- label smoothing -----


def test_bin_statistics_and_label_smoothing_targets_by_hand():
    # Confidences 0.35, 0.38 (bin 3: one right, one wrong -> acc 0.5) and 0.95, 1.0 (bin 9:
    # both right -> acc 1.0); bin 5 is empty.
    confidence = torch.tensor([0.35, 0.38, 0.95, 1.0])
    correct = torch.tensor([1, 0, 1, 1])
    accuracy, count = bin_statistics(confidence, correct)
    assert accuracy[3] == 0.5 and accuracy[9] == 1.0 and count[5] == 0
    assert count.tolist() == [0, 0, 0, 2, 0, 0, 0, 0, 0, 2]
    # A bin-3 sample: epsilon = 0.5, gold 0.5, the three others 0.5 / 3 each.
    soft = smoothed_targets(torch.tensor([2]), torch.tensor([0.5]), 4)
    torch.testing.assert_close(soft, torch.tensor([[1 / 6, 1 / 6, 0.5, 1 / 6]]))
    logits = torch.tensor([[1.0, 0.0, 2.0, -1.0]])
    log_p = logits - torch.logsumexp(logits, -1, keepdim=True)
    expected = -(soft * log_p).sum()
    assert soft_cross_entropy(logits, soft).item() == pytest.approx(expected.item(), rel=1e-6)


# ----- regularization, Iterate, CFT losses on a stub model -----


class _FixedLM(torch.nn.Module):
    """Stands in for a CalibratedLM: fixed raw logits, an optional head."""

    def __init__(self, logits: torch.Tensor, head=None) -> None:
        super().__init__()
        self.logits = torch.nn.Parameter(logits.clone())
        self.head = head

    def raw_logits(self, input_ids, attention_mask, logits_to_keep=0, params=None):
        return self.logits

    def adjust(self, logits, token_ids=None):
        return CalibratedLM.adjust(self, logits, token_ids)

    def head_parameters(self):
        return {} if self.head is None else dict(self.head.named_parameters())

    def adapter_parameters(self):
        return {"logits": self.logits}


def _batch():
    # One row, 4 positions; positions 1 and 2 predict the response tokens 3 and 1.
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 3, 1]])
    return {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "attention_mask": torch.ones(1, 4, dtype=torch.long),
        "labels": labels,
    }


def _hand_ce_and_entropy(rows: torch.Tensor, targets: list[int]):
    log_p = torch.log_softmax(rows, -1)
    ce = -torch.stack([log_p[i, t] for i, t in enumerate(targets)]).mean()
    entropy = -(log_p.exp() * log_p).sum(-1).mean()
    return ce, entropy


def test_regularization_loss_by_hand():
    logits = torch.tensor(
        [[[0.1, 0.2, 0.3, 0.4], [2.0, 0.0, 0.0, 1.0], [0.5, 1.5, -1.0, 0.0], [0.0, 0.0, 0.0, 0.0]]]
    )
    method = Regularization(_FixedLM(logits), alpha_reg=0.3)
    loss, logs = method.loss(_batch())
    ce, entropy = _hand_ce_and_entropy(logits[0, 1:3], [3, 1])
    assert loss.item() == pytest.approx((ce - 0.3 * entropy).item(), rel=1e-6)
    assert logs["entropy"] == pytest.approx(entropy.item(), rel=1e-6)


def test_iterate_losses_by_hand():
    logits = torch.tensor(
        [[[0.0, 1.0, 2.0, 3.0], [1.0, -1.0, 0.5, 2.0], [0.3, 0.2, 0.1, 0.0], [0.0, 0.0, 0.0, 0.0]]]
    )
    head = LogitAdjustment(4)
    with torch.no_grad():
        head.scale.copy_(torch.tensor([1.0, 0.5, 2.0, 1.5]))
        head.bias.copy_(torch.tensor([0.1, 0.0, -0.2, 0.3]))
    method = Iterate(_FixedLM(logits, head), ce_weight=0.9)
    adjusted = logits[0, 1:3] * head.scale.detach() + head.bias.detach()
    ce, entropy = _hand_ce_and_entropy(adjusted, [3, 1])
    assert method.lower_loss(_batch()).item() == pytest.approx(ce.item(), rel=1e-6)
    upper = method.upper_loss(_batch()).item()
    assert upper == pytest.approx((0.9 * ce - entropy).item(), rel=1e-6)


def test_cft_targets_sum_and_order():
    rest = torch.tensor([[0.3, 0.1, 0.05], [0.2, 0.2, 0.0]])  # sorted non-max probabilities
    accuracy = torch.tensor([0.6, 0.3])
    targets = cft_targets(rest, accuracy)
    torch.testing.assert_close(targets.sum(-1), 1 - accuracy)
    assert targets[0, 0] > targets[0, 1] > targets[0, 2]  # ordering follows the probabilities
    assert targets[1, 0] == pytest.approx(targets[1, 1].item())
    # By hand for row 0: gamma = ln 3 / (0.3 * 0.4), t_j = 0.4 (1 + tanh(g p_j)) / sum.
    gamma = math.log(3) / (0.3 * 0.4)
    weights = [1 + math.tanh(gamma * p) for p in (0.3, 0.1, 0.05)]
    expected = [0.4 * w / sum(weights) for w in weights]
    assert targets[0].tolist() == pytest.approx(expected, rel=1e-5)


def test_cft_calibration_loss_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1, 0.0], [0.1, 0.15, 0.7, 0.05]])
    bin_accuracy = torch.full((10,), 0.5)
    bin_accuracy[7] = 0.6
    bin_count = torch.full((10,), 4.0)
    loss = cft_calibration_loss(probs, bin_accuracy, bin_count).item()
    expected = 0.0
    for row in probs:
        ordered = sorted(row.tolist(), reverse=True)
        top, rest = ordered[0], torch.tensor([ordered[1:]])
        targets = cft_targets(rest, torch.tensor([0.6]))[0].tolist()
        spread = sum((p - t) ** 2 for p, t in zip(ordered[1:], targets, strict=True))
        expected += ((top - 0.6) ** 2 + spread) / 4
    assert loss == pytest.approx(expected, rel=1e-5)


# ----- end to end through the shared pipeline -----

TINY = ["model=tiny", "peft.r=4", "trainer.enable_progress_bar=false"]
DEMO = [
    "setting=demo",
    "setting.test.limit=16",
    "setting.eval_batch_size=8",
    "trainer.limit_train_batches=2",
]


@pytest.mark.integration
@pytest.mark.parametrize(
    ("method", "extra"),
    [
        ("ts", ["method.module.max_positions=256"]),
        ("reg", ["method.module.lr=1e-3"]),
        ("iterate", ["method.module.lower_steps=1", "method.module.upper_lr=0.05"]),
        ("cft", ["method.module.initial_pass_batches=2"]),
    ],
)
def test_methods_run_end_to_end_on_demo(tmp_path, method, extra, compose):
    cfg = compose([*TINY, *DEMO, f"method={method}", *extra], tmp_path)
    metrics = run_experiment(cfg).metrics
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["method"] == method and set(saved["comparison"]) == {"base", method}
    numbers = [v for k, v in metrics.items() if not isinstance(v, dict) and k != "auroc"]
    assert metrics["n"] == 16 and all(np.isfinite(v) for v in numbers)
    assert (tmp_path / "calibration").is_dir()
    if method == "ts":
        info = saved["posthoc"]
        assert info["fitted_on"] == "heldout_response_tokens" and 0.1 <= info["temperature"] <= 10
        assert info["nll_after"] <= info["nll_before"] + 1e-9
        # Accuracy is unchanged by a temperature.
        assert metrics["accuracy"] == saved["comparison"]["base"]["accuracy"]


@pytest.mark.integration
@pytest.mark.parametrize("method", ["ls", "ts", "reg"])
def test_methods_run_in_the_id_setting(tmp_path, method, compose, id_overrides):
    cfg = compose(
        [
            *TINY,
            f"method={method}",
            *id_overrides,
            "trainer.limit_train_batches=2",
            "trainer.max_epochs=1",
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 4
    saved = json.loads((tmp_path / "metrics.json").read_text())
    if method == "ts":
        assert saved["posthoc"]["fitted_on"] == "mcqa_calibration_half"
        assert saved["posthoc"]["n"] == 1  # half of the 2-item calibration split


# ----- histogram binning and isotonic regression (top-label) -----


def test_histogram_binning_by_hand_and_against_scikit_learn():
    from sklearn.calibration import calibration_curve

    from calm_lightning.calibrators.top_label import fit_histogram_binning

    # 2 equal-mass bins of 6: edge at the median (.45); {.1, .2, .3 | .6, .7, .9}
    conf = np.array([0.9, 0.1, 0.6, 0.2, 0.7, 0.3])
    hit = np.array([1, 0, 1, 1, 0, 0])
    fitted = fit_histogram_binning(conf, hit, n_bins=2)
    assert fitted.x == pytest.approx([0.45]) and fitted.y == pytest.approx([1 / 3, 2 / 3])
    assert fitted([0.05, 0.3, 0.46, 1.0]) == pytest.approx([1 / 3, 1 / 3, 2 / 3, 2 / 3])
    rng = np.random.default_rng(0)
    conf = rng.uniform(0.25, 1.0, 500)
    hit = (rng.uniform(size=500) < conf**2).astype(float)
    fitted = fit_histogram_binning(conf, hit, n_bins=10)
    expected, _ = calibration_curve(hit, conf, n_bins=10, strategy="quantile")
    assert fitted.y == pytest.approx(expected, abs=1e-12)
    assert fitted(conf) == pytest.approx(expected[np.searchsorted(fitted.x, conf)], abs=1e-12)


def _pool_adjacent_violators(x, y):
    """Isotonic fit of y on x (distinct x) by a plain loop: merge neighbouring blocks while a
    block's mean exceeds the next one's."""
    order = np.argsort(x)
    blocks = []  # [sum, count]
    for value in y[order]:
        blocks.append([float(value), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    fitted = np.concatenate([[total / count] * count for total, count in blocks])
    out = np.empty_like(fitted)
    out[order] = fitted
    return out


def test_isotonic_fit_matches_a_hand_pool_adjacent_violators_loop():
    from calm_lightning.calibrators.top_label import fit_isotonic

    rng = np.random.default_rng(1)
    conf = rng.uniform(0.25, 1.0, 300)
    hit = (rng.uniform(size=300) < conf**3).astype(float)
    fitted = fit_isotonic(conf, hit)
    assert fitted(conf) == pytest.approx(_pool_adjacent_violators(conf, hit), abs=1e-12)
    assert np.all(np.diff(fitted(np.linspace(0, 1, 101))) >= 0)
    assert fitted([0.0, 1.5]) == pytest.approx([fitted.y[0], fitted.y[-1]])  # clipped outside


def test_recalibrate_puts_the_mapped_confidence_on_the_answer():
    from calm_lightning.calibrators.top_label import TopLabelMap, recalibrate

    halve = TopLabelMap("isotonic", np.array([0.0, 1.0]), np.array([0.0, 0.5]), 2)
    probs = np.array([[0.6, 0.3, 0.1], [0.0, 1.0, 0.0], [0.2, 0.2, 0.6]])
    out, answer = recalibrate(probs, halve)
    assert answer.tolist() == [0, 1, 2]
    # .6 -> .3, the rest (.4) scaled to .7: .3 * 7/4, .1 * 7/4; a saturated row spreads evenly
    expected = np.array([[0.3, 0.525, 0.175], [0.25, 0.5, 0.25], [0.35, 0.35, 0.3]])
    assert np.allclose(out, expected, atol=1e-12)
    assert out.sum(1) == pytest.approx(np.ones(3))


@pytest.mark.integration
@pytest.mark.parametrize("method", ["hb", "isotonic"])
def test_top_label_maps_run_in_the_id_setting(tmp_path, method, compose, id_overrides):
    from calm_lightning.runtime.run_record import read_predictions

    cfg = compose([*TINY, f"method={method}", *id_overrides], tmp_path)
    metrics = run_experiment(cfg).metrics
    saved = json.loads((tmp_path / "metrics.json").read_text())
    info = saved["posthoc"]
    assert info["fitted_on"] == "mcqa_calibration_half" and info["n"] == 1
    assert info["map"] == {"hb": "histogram", "isotonic": "isotonic"}[method]
    assert (tmp_path / "calibration" / "top_label_map.json").is_file()
    # The answer is the base row's argmax: accuracy unchanged, the confidence mapped.
    assert metrics["accuracy"] == saved["comparison"]["base"]["accuracy"]
    base = {r["id"]: r for r in read_predictions(tmp_path / "base")}
    for row in read_predictions(tmp_path):
        assert row["prediction"] == base[row["id"]]["prediction"]
        assert sum(row["probs"]) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.integration
def test_histogram_binning_fits_on_held_out_response_tokens_out_of_domain(tmp_path, compose):
    cfg = compose([*TINY, *DEMO, "method=hb", "method.module.bins=4"], tmp_path)
    metrics = run_experiment(cfg).metrics
    saved = json.loads((tmp_path / "metrics.json").read_text())
    info = saved["posthoc"]
    assert info["fitted_on"] == "heldout_response_tokens" and info["n"] > 16
    assert len(info["y"]) == 4 and all(0 <= v <= 1 for v in info["y"])
    assert metrics["accuracy"] == saved["comparison"]["base"]["accuracy"]
    assert {"auroc", "aurc", "ci95"} <= set(metrics)


def test_label_smoothing_refuses_ood_before_loading_a_model(tmp_path, monkeypatch, compose):
    import calm_lightning.pipeline as pipeline

    def never(*args, **kwargs):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(pipeline, "load_language_model", never)
    cfg = compose(["method=ls", "setting=demo"], tmp_path)
    with pytest.raises(ConfigError, match="method=ls cannot run in setting=demo: label smoothing"):
        run_experiment(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ts", "reg"])
def test_baseline_on_the_embedded_model(tmp_path, method, compose):
    cfg = compose(
        [
            f"method={method}",
            "evaluation.scoring=letter",  # a temperature keeps the letter argmax (not cloze's)
            "setting.test.limit=64",
            "trainer.limit_train_batches=3",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    saved = json.loads((tmp_path / "metrics.json").read_text())
    base = saved["comparison"]["base"]
    numbers = [v for v in metrics.values() if not isinstance(v, dict)]  # not ci95, by_source
    assert all(np.isfinite(v) for v in numbers) and metrics["n"] == 64
    if method == "ts":
        # A temperature never changes the argmax, and it was fitted to lower held-out NLL.
        assert metrics["accuracy"] == base["accuracy"]
        assert saved["posthoc"]["nll_after"] < saved["posthoc"]["nll_before"]
    else:
        assert (tmp_path / "calibration" / "adapter" / "adapter_model.safetensors").is_file()
