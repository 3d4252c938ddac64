"""The vectorised bootstrap (calm_lightning/metrics/bootstrap.py) against the metric functions
called on each resample, a hand percentile, and the study script that now uses it."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from calm_lightning.metrics.bootstrap import (
    BootstrapSettings,
    ScoredQuestions,
    intervals,
    paired_differences,
    resample_counts,
)
from calm_lightning.metrics.calibration import (
    brier_score,
    calibration_report,
    confidence_ece,
    smooth_ece,
)


def _probs(n: int, k: int = 4, seed: int = 0, sharpen: float = 2.0, decimals: int | None = 2):
    """Seeded option probabilities and labels; rounding makes tied confidences."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, k, n)
    logits = rng.normal(size=(n, k)) + 1.2 * np.eye(k)[labels]
    p = np.exp(sharpen * logits)
    p /= p.sum(1, keepdims=True)
    if decimals is not None:
        p = np.round(p, decimals) + 1e-9
        p /= p.sum(1, keepdims=True)
    return p, labels


def _drawn(counts_row: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(counts_row.size), counts_row.astype(int))


@pytest.mark.parametrize("stated", [False, True], ids=["argmax", "stated"])
def test_the_identity_resample_is_the_run_report(stated):
    p, y = _probs(300)
    predictions = np.random.default_rng(1).integers(0, 4, 300) if stated else None
    row = ScoredQuestions.from_probs(p, y, predictions)
    report = calibration_report(p, y, predictions=predictions)
    point = row.point()
    assert set(point) == set(row.keys)
    for key, value in point.items():
        assert value == pytest.approx(report[key], abs=1e-12), key


def test_each_resample_is_the_report_of_the_questions_it_drew():
    p, y = _probs(120, seed=2)
    row = ScoredQuestions.from_probs(p, y, n_bins=7)
    counts = next(resample_counts(120, 4, seed=5))
    assert np.all(counts.sum(1) == 120)
    values = row.values(counts)
    for r in range(4):
        i = _drawn(counts[r])
        report = calibration_report(p[i], y[i], n_bins=7)
        for key in row.keys:
            assert values[key][r] == pytest.approx(report[key], abs=1e-12), (key, r)


def test_the_interval_is_the_percentile_of_a_loop_over_the_same_resamples():
    p, y = _probs(80, seed=3, decimals=None)
    settings = BootstrapSettings(resamples=60, seed=4, smece_resamples=3)
    ci = intervals(ScoredQuestions.from_probs(p, y), settings)
    assert "mean_confidence" not in ci and {"conf_ece", "auroc", "smece", "nll"} <= set(ci)
    counts = np.concatenate(list(resample_counts(80, 60, 4)))
    functions = {
        "conf_ece": confidence_ece,
        "brier": brier_score,
        "auroc": lambda q, t: roc_auc_score(t == q.argmax(1), q.max(1)),  # scikit-learn's
    }
    for key, fn in functions.items():
        loop = [fn(p[_drawn(c)], y[_drawn(c)]) for c in counts]
        assert ci[key] == pytest.approx(list(np.percentile(loop, [2.5, 97.5])), abs=1e-12)
    smooth = [smooth_ece(p[_drawn(c)], y[_drawn(c)]) for c in counts[:3]]
    assert ci["smece"] == pytest.approx(list(np.percentile(smooth, [2.5, 97.5])), abs=1e-12)
    assert intervals(ScoredQuestions.from_probs(p, y), settings) == ci  # seeded
    assert intervals(ScoredQuestions.from_probs(p, y), BootstrapSettings(resamples=0)) == {}


def test_an_undefined_auroc_has_no_interval():
    conf = np.linspace(0.3, 0.9, 20)
    ci = intervals(ScoredQuestions(conf, np.ones(20)), BootstrapSettings(20, 0, 0))
    assert ci["auroc"] == [None, None] and ci["accuracy"] == [1.0, 1.0]


def test_paired_differences_resample_both_rows_alike():
    p, y = _probs(150, seed=6, decimals=None)
    sharp, _ = _probs(150, seed=6, sharpen=4.0, decimals=None)
    a, b = ScoredQuestions.from_probs(p, y), ScoredQuestions.from_probs(sharp, y)
    settings = BootstrapSettings(resamples=50, seed=7, smece_resamples=0)
    out = paired_differences([(a, b)], ("conf_ece", "auroc"), settings)["conf_ece"]
    counts = np.concatenate(list(resample_counts(150, 50, 7)))
    loop = [
        confidence_ece(sharp[_drawn(c)], y[_drawn(c)]) - confidence_ece(p[_drawn(c)], y[_drawn(c)])
        for c in counts
    ]
    assert out.difference == pytest.approx(confidence_ece(sharp, y) - confidence_ece(p, y))
    assert out.ci95 == pytest.approx(tuple(np.percentile(loop, [2.5, 97.5])), abs=1e-12)
    assert out.standard_error == pytest.approx(np.std(loop, ddof=1), abs=1e-12)
    assert out.excludes_zero  # 4x sharper logits: clearly worse on 150 questions
    same = paired_differences([(a, a)], ("conf_ece",), settings)["conf_ece"]
    assert same.difference == 0 and same.ci95 == (0.0, 0.0) and not same.excludes_zero


def test_seeds_pair_on_their_own_questions_and_average():
    p1, y1 = _probs(60, seed=8, decimals=None)
    p2, y2 = _probs(90, seed=9, decimals=None)
    rows = [ScoredQuestions.from_probs(p, y) for p, y in ((p1, y1), (p2, y2))]
    settings = BootstrapSettings(resamples=30, seed=0, smece_resamples=0)
    out = paired_differences([(rows[0], rows[0]), (rows[1], rows[1])], ("nll",), settings)
    assert out["nll"].questions == 150 and out["nll"].difference == 0
    with pytest.raises(ValueError, match="same questions"):
        paired_differences([(rows[0], rows[1])], ("nll",), settings)


def test_the_study_script_reports_the_package_bootstrap():
    from studies.paired_bootstrap import compare

    p, y = _probs(100, seed=10, decimals=None)
    sharp, _ = _probs(100, seed=10, sharpen=3.0, decimals=None)
    out = compare(p, sharp, y, metric="classwise_ece", resamples=40, seed=3)
    pair = (ScoredQuestions.from_probs(p, y), ScoredQuestions.from_probs(sharp, y))
    mine = paired_differences([pair], ("cw_ece",), BootstrapSettings(40, 3, 0))["cw_ece"]
    assert out["difference"] == pytest.approx(mine.difference)
    assert out["ci95"] == pytest.approx(list(mine.ci95))
    assert out["questions"] == 100 and out["standard_error"] == pytest.approx(mine.standard_error)


def test_a_pooled_test_reports_each_source_and_their_macro_average():
    from calm_lightning.metrics.by_source import MIN_QUESTIONS, question_spread

    p, y = _probs(130, seed=11, decimals=None)
    sources = ["mmlu"] * 50 + ["arc"] * 60 + ["obqa"] * 20  # obqa under 30: marked, kept

    def row(index):
        index = slice(None) if index is None else index
        return ScoredQuestions.from_probs(p[index], y[index])

    out = question_spread(row, sources, BootstrapSettings(40, 0, 0))
    assert set(out) == {"ci95", "by_source"}
    rows = out["by_source"]["sources"]
    assert list(rows) == ["arc", "mmlu", "obqa"] and out["by_source"]["min_questions"] == 30
    for name, index in (
        ("mmlu", slice(0, 50)),
        ("arc", slice(50, 110)),
        ("obqa", slice(110, None)),
    ):
        report = calibration_report(p[index], y[index])
        for key in ("accuracy", "conf_ece", "nll", "brier", "n"):
            assert rows[name][key] == pytest.approx(report[key], abs=1e-12), (name, key)
        assert rows[name]["few_questions"] == (report["n"] < MIN_QUESTIONS)
        low, high = rows[name]["ci95"]["conf_ece"]
        assert low <= high
    macro = out["by_source"]["macro"]
    assert macro["conf_ece"] == pytest.approx(np.mean([r["conf_ece"] for r in rows.values()]))
    assert macro["n"] == 130 and macro["sources"] == 3 and "ci95" in macro
    single = question_spread(row, ["mmlu"] * 130, BootstrapSettings(10, 0, 0))
    assert "by_source" not in single  # one source: the row itself
