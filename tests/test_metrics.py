"""Calibration metrics against hand-worked numbers, torchmetrics and independent loop versions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from calm_lightning.metrics.calibration import (
    accuracy,
    adaptive_calibration_error,
    average_calibration_error,
    bin_indices,
    brier_score,
    calibration_report,
    classwise_ece,
    confidence_ece,
    debiased_calibration_error,
    equal_mass_ece,
    maximum_calibration_error,
    negative_log_likelihood,
    reliability_bins,
    smooth_ece,
)
from calm_lightning.metrics.ranking import aurc, auroc, selective_accuracy

# --- hand-worked examples -------------------------------------------------------------------

# Three options, four examples; with n_bins=2 the bins are [0, 0.5) and [0.5, 1].
#   row                  label  top option  conf  correct
#   [0.7, 0.2, 0.1]      0      0           0.7   yes
#   [0.2, 0.6, 0.2]      2      1           0.6   no
#   [0.3, 0.3, 0.4]      2      2           0.4   yes
#   [0.1, 0.8, 0.1]      1      1           0.8   yes
HAND3_PROBS = np.array(
    [[0.7, 0.2, 0.1], [0.2, 0.6, 0.2], [0.3, 0.3, 0.4], [0.1, 0.8, 0.1]], dtype=np.float64
)
HAND3_LABELS = np.array([0, 2, 2, 1])


def test_hand_three_classes_top_label():
    # bin 0: {0.4} acc 1, gap 0.6, weight 1/4 -> 0.15
    # bin 1: {0.7, 0.6, 0.8} mean conf 0.7, acc 2/3, gap 1/30, weight 3/4 -> 0.025
    # conf-ECE = 0.175; MCE = max(0.6, 1/30) = 0.6; accuracy = 3/4; mean confidence = 2.5/4
    assert confidence_ece(HAND3_PROBS, HAND3_LABELS, n_bins=2) == pytest.approx(0.175)
    assert maximum_calibration_error(HAND3_PROBS, HAND3_LABELS, n_bins=2) == pytest.approx(0.6)
    assert accuracy(HAND3_PROBS, HAND3_LABELS) == pytest.approx(0.75)


def test_hand_three_classes_classwise():
    # class 0: p0 = [.7, .2, .3, .1], y==0 = [1, 0, 0, 0]
    #   bin 0 {.2, .3, .1}: mean .2, freq 0 -> .2 * 3/4 = .15; bin 1 {.7}: freq 1 -> .3 * 1/4 = .075
    #   total .225
    # class 1: p1 = [.2, .6, .3, .8], y==1 = [0, 0, 0, 1]
    #   bin 0 {.2, .3}: mean .25, freq 0 -> .25 * 2/4 = .125; bin 1 {.6, .8}: mean .7, freq .5
    #   -> .2 * 2/4 = .1; total .225
    # class 2: p2 = [.1, .2, .4, .1], y==2 = [0, 1, 1, 0]
    #   bin 0 {all}: mean .2, freq .5 -> .3 * 4/4 = .3
    # cw-ECE = (.225 + .225 + .3) / 3 = .25
    assert classwise_ece(HAND3_PROBS, HAND3_LABELS, n_bins=2) == pytest.approx(0.25)


def test_hand_three_classes_brier_nll_ace():
    # Brier per row: (.7-1)^2+.2^2+.1^2 = .14; .2^2+.6^2+(.2-1)^2 = 1.04;
    #                .3^2+.3^2+(.4-1)^2 = .54;  .1^2+(.8-1)^2+.1^2 = .06  -> mean 1.78/4 = .445
    assert brier_score(HAND3_PROBS, HAND3_LABELS) == pytest.approx(0.445)
    # NLL: p_y = .7, .2, .4, .8
    expected_nll = -(math.log(0.7) + math.log(0.2) + math.log(0.4) + math.log(0.8)) / 4
    assert negative_log_likelihood(HAND3_PROBS, HAND3_LABELS) == pytest.approx(expected_nll)
    # ACE, 2 ranges of 2 sorted values per class:
    #   class 0 sorted [.1 .2 | .3 .7], hits [0 0 | 0 1]: |0-.15| = .15, |.5-.5| = 0
    #   class 1 sorted [.2 .3 | .6 .8], hits [0 0 | 0 1]: |0-.25| = .25, |.5-.7| = .2
    #   class 2 sorted [.1 .1 | .2 .4], hits [0 0 | 1 1]: |0-.1| = .1, |1-.3| = .7
    #   ACE = (.15 + 0 + .25 + .2 + .1 + .7) / 6 = 1.4 / 6
    ace = adaptive_calibration_error(HAND3_PROBS, HAND3_LABELS, n_ranges=2)
    assert ace == pytest.approx(1.4 / 6)


def test_hand_three_classes_average_calibration_error():
    # netcal's "ACE": top-label bins as for conf-ECE, but each non-empty bin weighs the same.
    # bin 0 {0.4}: gap 0.6; bin 1 {0.7, 0.6, 0.8}: gap 1/30 -> (0.6 + 1/30) / 2 = 0.31667,
    # against conf-ECE 0.175 (weights 1/4, 3/4) and the adaptive ACE 1.4 / 6 = 0.2333.
    assert average_calibration_error(HAND3_PROBS, HAND3_LABELS, n_bins=2) == pytest.approx(
        (0.6 + 1 / 30) / 2
    )
    # One example per bin: the unweighted and weighted means coincide (the case below).
    probs = np.array([[0.95, 0.05], [0.85, 0.15], [0.25, 0.75], [0.65, 0.35]])
    assert average_calibration_error(probs, np.array([0, 1, 1, 0])) == pytest.approx(0.375)
    # Empty bins do not count: 9 of the 10 bins are empty here.
    probs = np.array([[0.92, 0.08], [0.96, 0.04], [0.94, 0.06]])
    assert average_calibration_error(probs, np.array([0, 1, 0])) == pytest.approx(abs(2 / 3 - 0.94))


def test_hand_two_classes_ten_bins():
    # Every value sits mid-bin, so each example has a bin of its own in both views.
    #   conf .95 correct (gap .05), .85 wrong (.85), .75 correct (.25), .65 correct (.35)
    #   conf-ECE = (.05 + .85 + .25 + .35) / 4 = .375; MCE = .85
    # With K = 2 class 1 mirrors class 0, and with singleton bins each class sums the same gaps,
    # so cw-ECE = .375 as well.
    probs = np.array([[0.95, 0.05], [0.85, 0.15], [0.25, 0.75], [0.65, 0.35]])
    labels = np.array([0, 1, 1, 0])
    assert confidence_ece(probs, labels) == pytest.approx(0.375)
    assert maximum_calibration_error(probs, labels) == pytest.approx(0.85)
    assert classwise_ece(probs, labels) == pytest.approx(0.375)
    # Brier: both options miss by the same amount, 2 * (.05^2 + .85^2 + .25^2 + .35^2) / 4
    #      = 2 * (.0025 + .7225 + .0625 + .1225) / 4 = 2 * .91 / 4 = .455
    assert brier_score(probs, labels) == pytest.approx(0.455)


def test_report_keys_values_and_torch_input():
    report = calibration_report(HAND3_PROBS, HAND3_LABELS, n_bins=2)
    assert list(report) == [
        "accuracy",
        "conf_ece",
        "cw_ece",
        "mce",
        "ace",
        "avg_ce",
        "brier",
        "nll",
        "ece_em",
        "rmsce_debiased",
        "smece",
        "auroc",
        "aurc",
        "sel_acc_80",
        "mean_confidence",
        "n",
    ]
    assert report["n"] == 4 and isinstance(report["n"], int)
    # top-label pairs (conf, correct): (.7, 1), (.6, 0), (.4, 1), (.8, 1)
    # AUROC: the wrong .6 is below .7 and .8, above .4 -> 2/3
    # risk by coverage (.8, .7, .6, .4): 0, 0, 1/3, 1/4 -> AURC 7/48; 80 % = all 4 -> 3/4
    # equal mass, 2 ranges: {.4, .6} conf .5 acc .5 gap 0; {.7, .8} conf .75 acc 1 gap .25
    # -> EM-ECE .125; debiased: .5 (0 - .25 / 1) + .5 (.0625 - 0) < 0 -> 0
    assert report["auroc"] == pytest.approx(2 / 3)
    assert report["aurc"] == pytest.approx(7 / 48)
    assert report["sel_acc_80"] == pytest.approx(0.75)
    assert report["ece_em"] == pytest.approx(0.125)
    assert report["rmsce_debiased"] == 0.0
    assert report["mean_confidence"] == pytest.approx(2.5 / 4)
    assert report["conf_ece"] == pytest.approx(0.175)
    assert report["cw_ece"] == pytest.approx(0.25)
    assert report["ace"] == pytest.approx(1.4 / 6)
    assert report["avg_ce"] == pytest.approx((0.6 + 1 / 30) / 2)
    # Torch tensors give the same numbers as numpy input.
    as_torch = calibration_report(
        torch.tensor(HAND3_PROBS, dtype=torch.float32), torch.tensor(HAND3_LABELS), n_bins=2
    )
    for key, value in report.items():
        assert as_torch[key] == pytest.approx(value, abs=1e-6), key


def test_bf16_tensor_input():
    # bf16 has no numpy dtype; these values are exact in bf16 so the rows still sum to 1.
    probs = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.75, 0.125]], dtype=torch.bfloat16)
    # conf .5 (correct, bin 5) and .75 (wrong, bin 7): ECE = (.5 + .75) / 2
    assert confidence_ece(probs, torch.tensor([0, 0])) == pytest.approx(0.625)


# --- binning edge cases ---------------------------------------------------------------------


def test_bin_indices_edges():
    idx = bin_indices(np.array([0.0, 0.05, 0.1, 0.55, 0.999, 1.0]), n_bins=10)
    assert idx.tolist() == [0, 0, 1, 5, 9, 9]
    assert bin_indices([0.0, 0.5, 1.0], n_bins=1).tolist() == [0, 0, 0]


def test_confidence_one_is_in_last_bin():
    # Both correct: bin 9 holds {1.0, .95}, mean conf .975, acc 1 -> ECE .025.
    probs = np.array([[1.0, 0.0], [0.95, 0.05]])
    assert confidence_ece(probs, np.array([0, 0])) == pytest.approx(0.025)
    bins = reliability_bins(probs.max(axis=1), [True, True])
    assert bins.counts.tolist() == [0] * 9 + [2]
    assert bins.mean_confidence[9] == pytest.approx(0.975)
    assert np.isnan(bins.mean_confidence[:9]).all() and np.isnan(bins.accuracy[:9]).all()
    assert bins.edges.tolist() == pytest.approx(np.linspace(0, 1, 11).tolist())

    # Where the choice matters: 1.0 wrong, .95 right. Shared last bin: mean conf .975, acc .5
    # -> .475. A separate bin for 1.0 (torchmetrics) gives (1 + .05) / 2 = .525.
    labels = np.array([1, 0])
    assert confidence_ece(probs, labels) == pytest.approx(0.475)
    tm = _tm_calibration_error(probs, labels, "l1")
    assert tm == pytest.approx(0.525), "torchmetrics changed its 1.0 binning; update the docstring"


# --- cross-checks against independent implementations ---------------------------------------


def _tm_calibration_error(probs: np.ndarray, labels: np.ndarray, norm: str) -> float:
    # torchmetrics casts confidences to float32 internally, hence abs=1e-6 in the comparisons.
    from torchmetrics.functional.classification import multiclass_calibration_error

    return float(
        multiclass_calibration_error(
            torch.tensor(probs, dtype=torch.float64),
            torch.tensor(labels),
            num_classes=probs.shape[1],
            n_bins=10,
            norm=norm,
        )
    )


def _random_case(seed: int, k: int, n: int = 500, alpha: float = 1.0):
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(k, alpha), size=n)
    # Mixing in a little uniform mass keeps every confidence strictly below 1.0, where
    # torchmetrics and this module agree on the binning.
    probs = 0.999 * probs + 0.001 / k
    labels = rng.integers(0, k, size=n)
    # Make the model better than chance so that bins hold both hits and misses.
    agree = rng.random(n) < 0.5
    labels[agree] = probs[agree].argmax(axis=1)
    return probs, labels


CASES = [(seed, k, alpha) for seed in (0, 1, 2) for k, alpha in ((2, 0.5), (4, 1.0), (7, 0.3))]


@pytest.mark.parametrize(("seed", "k", "alpha"), CASES)
def test_top_label_matches_torchmetrics(seed, k, alpha):
    probs, labels = _random_case(seed, k, alpha=alpha)
    assert probs.max() < 1.0
    assert confidence_ece(probs, labels) == pytest.approx(
        _tm_calibration_error(probs, labels, "l1"), abs=1e-6
    )
    assert maximum_calibration_error(probs, labels) == pytest.approx(
        _tm_calibration_error(probs, labels, "max"), abs=1e-6
    )


@pytest.mark.parametrize(("seed", "k", "alpha"), CASES)
def test_brier_and_nll_match_independent(seed, k, alpha):
    probs, labels = _random_case(seed, k, alpha=alpha)
    diff = probs - np.eye(k)[labels]
    assert brier_score(probs, labels) == pytest.approx(np.einsum("nk,nk->n", diff, diff).mean())
    loop = sum(
        sum((probs[i, c] - (1.0 if c == labels[i] else 0.0)) ** 2 for c in range(k))
        for i in range(len(labels))
    ) / len(labels)
    assert brier_score(probs, labels) == pytest.approx(loop)
    t_probs = torch.tensor(probs, dtype=torch.float64)
    torch_nll = torch.nn.functional.nll_loss(torch.log(t_probs), torch.tensor(labels)).item()
    assert negative_log_likelihood(probs, labels) == pytest.approx(torch_nll)
    assert accuracy(probs, labels) == pytest.approx(
        float((t_probs.argmax(dim=1) == torch.tensor(labels)).double().mean())
    )


def _loop_classwise_ece(probs: np.ndarray, labels: np.ndarray, n_bins: int) -> float:
    n, k = probs.shape
    total = 0.0
    for j in range(k):
        for b in range(n_bins):
            lo, hi = b / n_bins, (b + 1) / n_bins
            members = []
            for i in range(n):
                p = float(probs[i, j])
                if lo <= p < hi or (b == n_bins - 1 and p == 1.0):
                    members.append(i)
            if not members:
                continue
            mean_p = sum(float(probs[i, j]) for i in members) / len(members)
            freq = sum(1.0 for i in members if labels[i] == j) / len(members)
            total += len(members) / n * abs(freq - mean_p)
    return total / k


def _loop_average_calibration_error(conf: np.ndarray, correct: np.ndarray, n_bins: int) -> float:
    """netcal's average calibration error re-derived: equal-width bins [b/n, (b+1)/n) (the last
    one closed), |accuracy - mean confidence| per non-empty bin, averaged without weights."""
    gaps = []
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [i for i, c in enumerate(conf) if lo <= c < hi or (b == n_bins - 1 and c == 1.0)]
        if members:
            acc = sum(1.0 for i in members if correct[i]) / len(members)
            mean_conf = sum(float(conf[i]) for i in members) / len(members)
            gaps.append(abs(acc - mean_conf))
    return sum(gaps) / len(gaps)


@pytest.mark.parametrize(("seed", "k", "n_bins"), [(3, 2, 10), (4, 4, 10), (5, 5, 15), (6, 3, 7)])
def test_average_calibration_error_matches_loop(seed, k, n_bins):
    probs, labels = _random_case(seed, k, n=300)
    top = probs.argmax(axis=1)
    conf, correct = probs.max(axis=1), top == labels
    expected = _loop_average_calibration_error(conf, correct, n_bins)
    assert average_calibration_error(probs, labels, n_bins) == pytest.approx(expected, abs=1e-12)
    report = calibration_report(probs, labels, n_bins=n_bins)
    assert report["avg_ce"] == pytest.approx(expected, abs=1e-12)
    # With a stated answer (IC, elicitation) it reads that answer's probability, like conf-ECE.
    stated = (top + 1) % k
    conf_s, correct_s = probs[np.arange(len(labels)), stated], stated == labels
    with_stated = calibration_report(probs, labels, n_bins=n_bins, predictions=stated)
    assert with_stated["avg_ce"] == pytest.approx(
        _loop_average_calibration_error(conf_s, correct_s, n_bins), abs=1e-12
    )
    # Unweighted over bins, so it differs from conf-ECE whenever bin sizes differ.
    assert report["avg_ce"] != pytest.approx(report["conf_ece"], abs=1e-6)


@pytest.mark.parametrize(("seed", "k", "n_bins"), [(3, 2, 10), (4, 4, 10), (5, 5, 15), (6, 3, 7)])
def test_classwise_matches_loop(seed, k, n_bins):
    probs, labels = _random_case(seed, k, n=300)
    expected = _loop_classwise_ece(probs, labels, n_bins)
    assert classwise_ece(probs, labels, n_bins=n_bins) == pytest.approx(expected, abs=1e-12)


def test_classwise_loop_counts_one_in_last_bin():
    probs = np.array([[1.0, 0.0, 0.0], [0.95, 0.05, 0.0], [0.0, 0.3, 0.7]])
    labels = np.array([1, 0, 2])
    assert classwise_ece(probs, labels) == pytest.approx(_loop_classwise_ece(probs, labels, 10))


# --- ACE ------------------------------------------------------------------------------------


def test_ace_small_when_calibrated_large_when_overconfident():
    rng = np.random.default_rng(11)
    k, n = 4, 20_000
    probs = rng.dirichlet(np.ones(k), size=n)
    # Labels drawn from the predicted distribution: calibrated for every class by construction.
    cdf = probs.cumsum(axis=1)
    labels = np.minimum((rng.random((n, 1)) > cdf).sum(axis=1), k - 1)
    assert adaptive_calibration_error(probs, labels) < 0.02

    # Same labels, but the model reports sharpened probabilities (temperature 0.25).
    sharp = probs**4
    sharp /= sharp.sum(axis=1, keepdims=True)
    assert adaptive_calibration_error(sharp, labels) > 0.08
    assert confidence_ece(sharp, labels) > 0.1


def test_ace_fewer_examples_than_ranges():
    # 3 examples, 10 ranges: only non-empty ranges count, i.e. each value on its own.
    probs = np.array([[0.9, 0.1], [0.4, 0.6], [0.2, 0.8]])
    labels = np.array([0, 0, 1])
    # class 0: |1-.9| + |1-.4| + |0-.2| = .1 + .6 + .2; class 1 mirrors it -> mean .9 / 3
    assert adaptive_calibration_error(probs, labels) == pytest.approx(0.3)


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("probs", "labels", "match"),
    [
        ([[0.5, 0.4], [0.5, 0.5]], [0, 1], "sum to 1"),
        ([[2.0, -1.0], [0.5, 0.5]], [0, 1], "negative"),
        ([[np.nan, 1.0], [0.5, 0.5]], [0, 1], "NaN"),
        ([[np.inf, 0.0], [0.5, 0.5]], [0, 1], "NaN or inf"),
        ([0.5, 0.5], [0], "2-D"),
        (np.zeros((2, 2, 2)), [0, 1], "2-D"),
        (np.zeros((0, 3)), [], "at least one"),
        ([[0.5, 0.5], [0.5, 0.5]], [[0, 1]], "1-D"),
        ([[0.5, 0.5], [0.5, 0.5]], [0, 1, 1], "3 entries"),
        ([[0.5, 0.5], [0.5, 0.5]], [0, 2], r"\[0, 2\)"),
        ([[0.5, 0.5], [0.5, 0.5]], [-1, 0], r"\[0, 2\)"),
        ([[0.5, 0.5], [0.5, 0.5]], [0.0, 1.0], "integer"),
    ],
)
def test_validation_errors(probs, labels, match):
    with pytest.raises(ValueError, match=match):
        calibration_report(np.asarray(probs, dtype=np.float64), np.asarray(labels))
    with pytest.raises(ValueError, match=match):
        confidence_ece(np.asarray(probs, dtype=np.float64), np.asarray(labels))


def test_bin_argument_validation():
    with pytest.raises(ValueError, match="n_bins"):
        confidence_ece(HAND3_PROBS, HAND3_LABELS, n_bins=0)
    with pytest.raises(ValueError, match="n_ranges"):
        adaptive_calibration_error(HAND3_PROBS, HAND3_LABELS, n_ranges=0)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        bin_indices([0.2, 1.5])
    with pytest.raises(ValueError, match="0/1"):
        reliability_bins([0.2, 0.7], [0, 2])


def test_float32_softmax_rows_are_accepted():
    logits = torch.randn(64, 5, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits.float(), dim=-1)
    assert calibration_report(probs, torch.zeros(64, dtype=torch.long))["n"] == 64


# --- plotting -------------------------------------------------------------------------------


def test_plot_writes_png(tmp_path):
    import matplotlib.image

    from calm_lightning.metrics.reliability import plot_reliability_diagram

    probs, labels = _random_case(7, 4, n=400)
    out = plot_reliability_diagram(
        probs, labels, tmp_path / "nested" / "dir" / "rel.png", title="test run"
    )
    assert out == tmp_path / "nested" / "dir" / "rel.png"
    data = out.read_bytes()
    assert len(data) > 10_000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(out)
    height, width = image.shape[:2]
    assert 400 <= height <= 2000 and 800 <= width <= 3000
    # Not a blank canvas: the bars and markers leave many distinct colours.
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 20


def test_plot_accepts_torch_and_str_path(tmp_path):
    from calm_lightning.metrics.reliability import plot_reliability_diagram

    out = plot_reliability_diagram(
        torch.tensor(HAND3_PROBS), torch.tensor(HAND3_LABELS), str(tmp_path / "small.png"), n_bins=2
    )
    assert out.exists() and out.stat().st_size > 0


# --- ranking, equal-mass, debiased and smooth errors ------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auroc_matches_scikit_learn_with_ties(seed):
    from sklearn.metrics import roc_auc_score

    probs, labels = _random_case(seed, 4, n=300)
    probs = np.round(probs, 1) + 1e-9  # many tied confidences
    probs /= probs.sum(1, keepdims=True)
    conf, correct = probs.max(1), probs.argmax(1) == labels
    expected = roc_auc_score(correct, conf)
    assert auroc(conf, correct) == pytest.approx(expected, abs=1e-12)
    assert calibration_report(probs, labels)["auroc"] == pytest.approx(expected, abs=1e-12)
    assert math.isnan(auroc(conf, np.ones_like(correct)))  # one class: undefined


def _risk_by_loop(conf, correct, order):
    """risk[k - 1] = the error rate of the first k answers taken in `order`."""
    wrong = [0 if correct[i] else 1 for i in order]
    return [sum(wrong[:k]) / k for k in range(1, len(order) + 1)]


def test_risk_coverage_averages_the_orders_of_tied_answers():
    import itertools

    from calm_lightning.metrics.ranking import risk_coverage

    conf = np.array([0.9, 0.5, 0.9, 0.7, 0.5, 0.5])
    correct = np.array([1, 0, 0, 1, 1, 0])
    # every order that sorts confidence descending: the ties {0, 2} and {1, 4, 5} permuted
    orders = [
        [*top, 3, *low]
        for top in itertools.permutations([0, 2])
        for low in itertools.permutations([1, 4, 5])
    ]
    expected = np.mean([_risk_by_loop(conf, correct, o) for o in orders], 0)
    assert risk_coverage(conf, correct) == pytest.approx(expected, abs=1e-12)
    assert aurc(conf, correct) == pytest.approx(expected.mean(), abs=1e-12)
    # 80 % of 6 = 4.8 -> the 5 most confident
    assert selective_accuracy(conf, correct) == pytest.approx(1 - expected[4], abs=1e-12)
    assert selective_accuracy(conf, correct, 0.5) == pytest.approx(1 - expected[2], abs=1e-12)


@pytest.mark.parametrize("seed", [3, 4])
def test_aurc_matches_a_loop_without_ties(seed):
    probs, labels = _random_case(seed, 4, n=200)
    conf, correct = probs.max(1), probs.argmax(1) == labels
    risk = _risk_by_loop(conf, correct, np.argsort(-conf))
    assert aurc(conf, correct) == pytest.approx(np.mean(risk), abs=1e-12)
    assert selective_accuracy(conf, correct) == pytest.approx(1 - risk[159], abs=1e-12)


def _ranges_by_loop(conf, correct, n_ranges):
    """(size, mean conf, accuracy) of each equal-mass range, by a plain loop."""
    order = sorted(range(len(conf)), key=lambda i: (conf[i], i))
    size, start, out = len(order) // n_ranges, 0, []
    extra = len(order) % n_ranges
    for r in range(n_ranges):
        stop = start + size + (1 if r < extra else 0)
        chunk = order[start:stop]
        if chunk:
            out.append(
                (len(chunk), sum(conf[i] for i in chunk) / len(chunk),
                 sum(correct[i] for i in chunk) / len(chunk))
            )  # fmt: skip
        start = stop
    return out


@pytest.mark.parametrize(("seed", "n_bins"), [(5, 10), (6, 7), (7, 15)])
def test_equal_mass_and_debiased_errors_match_a_loop(seed, n_bins):
    probs, labels = _random_case(seed, 4, n=203)
    conf, correct = probs.max(1), (probs.argmax(1) == labels).astype(float)
    ranges = _ranges_by_loop(conf, correct, n_bins)
    n = len(conf)
    ece = sum(size / n * abs(acc - c) for size, c, acc in ranges)
    squared = sum(
        size / n * ((acc - c) ** 2 - acc * (1 - acc) / (size - 1)) for size, c, acc in ranges
    )
    assert equal_mass_ece(probs, labels, n_bins) == pytest.approx(ece, abs=1e-12)
    expected = math.sqrt(max(0.0, squared))
    assert debiased_calibration_error(probs, labels, n_bins) == pytest.approx(expected, abs=1e-12)
    report = calibration_report(probs, labels, n_bins=n_bins)
    assert report["ece_em"] == pytest.approx(ece, abs=1e-12)
    assert report["rmsce_debiased"] == pytest.approx(expected, abs=1e-12)


def test_the_debiased_error_removes_the_plug_in_bias_of_a_calibrated_model():
    """Answers right with probability equal to their confidence: the plug-in squared error of
    equal-mass ranges is positive by construction; the debiased one averages near zero."""
    from calm_lightning.metrics.calibration import _debiased_squared_ce

    rng = np.random.default_rng(8)
    plug_in, debiased = [], []
    for _ in range(200):
        conf = rng.uniform(0.3, 1.0, 200)
        hit = (rng.uniform(size=200) < conf).astype(float)
        ranges = _ranges_by_loop(conf, hit, 10)
        plug_in.append(sum(s / 200 * (a - c) ** 2 for s, c, a in ranges))
        debiased.append(_debiased_squared_ce(conf, hit, 10))
    assert np.mean(plug_in) > 0.008  # about the mean of acc (1 - acc) / 19
    assert abs(np.mean(debiased)) < 0.1 * np.mean(plug_in)


def test_smooth_ece_matches_a_direct_kernel_sum():
    """relplot's smECE against the reflected-Gaussian kernel smoother summed directly (no grid),
    at the bandwidth relplot chose, which is its own fixed point (smECE_sigma = sigma)."""
    import relplot
    from scipy.stats import norm

    rng = np.random.default_rng(9)
    for shape in (1.0, 2.0):  # calibrated, over-confident
        f = rng.uniform(0.25, 1.0, 300)
        y = (rng.uniform(size=300) < f**shape).astype(float)
        value, sigma = relplot.smECE(f, y, return_width=True)
        t = np.linspace(0, 1, max(200, round(10 / sigma)))
        # reflections at 0 and 1 keep the kernel's mass inside [0, 1]
        k = sum(norm.pdf(t[:, None] - image[None, :], scale=sigma) for image in (f, -f, 2 - f))
        direct = np.abs(k @ (f - y)).sum() / k.sum()
        assert value == pytest.approx(direct, abs=1e-3)
        assert value == pytest.approx(sigma, abs=2e-3)
    # through the metric's own entry: top-label pairs of option vectors (option 0 on top)
    top = f > 0.5
    probs = np.stack([f[top], 1 - f[top]], 1)
    expected = relplot.smECE(f[top], y[top])
    assert smooth_ece(probs, 1 - y[top].astype(int)) == pytest.approx(expected, abs=1e-12)
