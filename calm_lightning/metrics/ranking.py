"""How well confidence ranks right answers above wrong ones, whatever its scale: AUROC of
confidence against correctness, the area under the risk–coverage curve (AURC) and the accuracy
of the most confident answers at a fixed coverage.

A temperature never changes these (it keeps every question's order), while a per-token head or
adapters can: they separate "better calibrated" from "better ranked". All three take top-label
(confidence, correct) pairs as NumPy arrays; tied confidences count as if their order were
random (AUROC counts a tie as half a win; AURC and selective accuracy average over the orders of
a tied group), so the result never depends on question order.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["aurc", "auroc", "risk_coverage", "selective_accuracy"]

SELECTIVE_COVERAGE = 0.8  # the coverage metrics.json's `sel_acc_80` is read at


def _pairs(confidences: Any, correct: Any) -> tuple[np.ndarray, np.ndarray]:
    conf = np.asarray(confidences, dtype=np.float64)
    hit = np.asarray(correct, dtype=np.float64)
    if conf.ndim != 1 or hit.shape != conf.shape or conf.size == 0:
        raise ValueError(
            f"confidences and correct must be 1-D of equal, non-zero length, got {conf.shape} "
            f"and {hit.shape}"
        )
    if not np.all(np.isfinite(conf)):
        raise ValueError("confidences contain NaN or inf")
    if np.any((hit != 0) & (hit != 1)):
        raise ValueError("correct must contain only 0/1 (or booleans)")
    return conf, hit


def auroc(confidences: Any, correct: Any) -> float:
    """P(confidence of a right answer > that of a wrong one), ties counted half (the
    Mann–Whitney statistic); NaN when every answer is right or every answer is wrong."""
    from scipy.stats import rankdata

    conf, hit = _pairs(confidences, correct)
    n_right = hit.sum()
    n_wrong = hit.size - n_right
    if n_right == 0 or n_wrong == 0:
        return math.nan
    ranks = rankdata(conf)  # tied values share their average rank: a tie counts half
    return float((ranks[hit == 1].sum() - n_right * (n_right + 1) / 2) / (n_right * n_wrong))


def risk_coverage(confidences: Any, correct: Any) -> np.ndarray:
    """risk[k - 1] = the expected error rate of the k most confident answers, k = 1..N (a tied
    group that straddles k contributes its mean error rate per answer taken)."""
    conf, hit = _pairs(confidences, correct)
    order = np.argsort(-conf, kind="stable")
    conf, err = conf[order], 1.0 - hit[order]
    starts = np.flatnonzero(np.r_[True, conf[1:] != conf[:-1]])
    sizes = np.diff(np.r_[starts, conf.size])
    group_err = np.add.reduceat(err, starts)
    err_before = np.cumsum(group_err) - group_err
    group = np.repeat(np.arange(starts.size), sizes)
    taken = np.arange(1, conf.size + 1)
    within = taken - starts[group]  # answers taken from the current tied group
    return (err_before[group] + within * group_err[group] / sizes[group]) / taken


def aurc(confidences: Any, correct: Any) -> float:
    """Area under the risk–coverage curve: the mean over k = 1..N of the error rate of the k
    most confident answers (Geifman et al. 2019). Lower is better; it mixes accuracy and
    ranking (a perfect ranker's AURC is not 0 unless every answer is right)."""
    return float(np.mean(risk_coverage(confidences, correct)))


def selective_accuracy(
    confidences: Any, correct: Any, coverage: float = SELECTIVE_COVERAGE
) -> float:
    """Accuracy of the ceil(coverage * N) most confident answers."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must lie in (0, 1], got {coverage}")
    risk = risk_coverage(confidences, correct)
    taken = max(1, math.ceil(coverage * risk.size - 1e-9))
    return float(1.0 - risk[taken - 1])
