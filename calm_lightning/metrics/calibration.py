"""Calibration metrics for multiple-choice predictions: the one implementation used everywhere.

Every metric takes ``probs`` of shape (N, K) (rows are probability vectors over the K answer
options) and integer ``labels`` of shape (N,), as numpy arrays or torch tensors, and computes in
float64 numpy.

Why hand-written rather than torchmetrics:

* Class-wise ECE (Kull et al. 2019), adaptive calibration error (Nixon et al. 2019) and netcal's
  average calibration error are not in torchmetrics, and every metric in a report must share one
  binning rule, so they all live here.
* torchmetrics bins with ``bucketize(conf, linspace(0, 1, n_bins + 1), right=True) - 1``, which
  sends a confidence of exactly 1.0 to a hidden (n_bins + 1)-th bin instead of the last bin
  [0.9, 1.0]. Fine-tuned LLMs do emit saturated probabilities, so the two can disagree; here a
  1.0 is counted in the last bin, like every other value in [1 - 1/n_bins, 1].

``tests/test_metrics.py`` cross-checks the confidence ECE and MCE against torchmetrics (on inputs
whose confidences stay below 1.0), and the other metrics against independent computations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from calm_lightning.metrics.ranking import SELECTIVE_COVERAGE, aurc, auroc, selective_accuracy

__all__ = [
    "ReliabilityBins",
    "accuracy",
    "adaptive_calibration_error",
    "average_calibration_error",
    "bin_indices",
    "brier_rows",
    "brier_score",
    "calibration_report",
    "classwise_ece",
    "confidence_ece",
    "debiased_calibration_error",
    "equal_mass_ece",
    "maximum_calibration_error",
    "negative_log_likelihood",
    "nll_rows",
    "reliability_bins",
    "smooth_ece",
    "top_label_pairs",
    "validate_inputs",
]

# Slack for probabilities that went through float32/bf16 softmax: rows may miss 1 by ~1e-6.
_PROB_TOL = 1e-4
_NLL_EPS = 1e-12


def _as_numpy(x: Any, dtype: Any = None) -> np.ndarray:
    """Return ``x`` (numpy array, torch tensor or sequence) as a numpy array."""
    # Duck-typed so that numpy-only callers never import torch.
    if hasattr(x, "detach") and hasattr(x, "cpu"):
        x = x.detach().cpu()
        if x.is_floating_point():
            # bf16/fp16 tensors have no numpy equivalent; widen before converting.
            x = x.double()
        x = x.numpy()
    return np.asarray(x, dtype=dtype)


def _check_n_bins(n_bins: int, name: str = "n_bins") -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, (int, np.integer)) or n_bins < 1:
        raise ValueError(f"{name} must be a positive integer, got {n_bins!r}")
    return int(n_bins)


def _validate_probs(probs: Any) -> np.ndarray:
    p = _as_numpy(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must be 2-D (N examples, K options), got shape {p.shape}")
    if p.shape[0] == 0 or p.shape[1] == 0:
        raise ValueError(f"probs must have at least one example and one option, got {p.shape}")
    if not np.all(np.isfinite(p)):
        bad = int(np.argwhere(~np.isfinite(p))[0, 0])
        raise ValueError(f"probs contains NaN or inf (first in row {bad})")
    if np.any(p < 0):
        bad = int(np.argwhere(p < 0)[0, 0])
        raise ValueError(
            f"probs contains negative values (first in row {bad}); pass softmax output"
        )
    sums = p.sum(axis=1)
    off = np.abs(sums - 1.0) > _PROB_TOL
    if np.any(off):
        bad = int(np.argmax(off))
        raise ValueError(
            f"probs rows must sum to 1 (tolerance {_PROB_TOL:g}); {int(off.sum())} rows do not, "
            f"e.g. row {bad} sums to {sums[bad]:.6g}; pass probabilities, not logits"
        )
    return p


def validate_inputs(probs: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """Check ``probs`` (N, K) and ``labels`` (N,); return them as float64 and int64 arrays."""
    p = _validate_probs(probs)
    y = _as_numpy(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be 1-D (N,), got shape {y.shape}")
    if y.shape[0] != p.shape[0]:
        raise ValueError(f"labels has {y.shape[0]} entries but probs has {p.shape[0]} rows")
    if y.dtype.kind not in "iu":
        raise ValueError(f"labels must be integer class indices, got dtype {y.dtype}")
    y = y.astype(np.int64)
    k = p.shape[1]
    out = (y < 0) | (y >= k)
    if np.any(out):
        bad = int(np.argmax(out))
        raise ValueError(f"labels must lie in [0, {k}), got {int(y[bad])} at index {bad}")
    return p, y


def bin_indices(values: Any, n_bins: int = 10) -> np.ndarray:
    """Equal-width bin index of each value in [0, 1]: bins are [b/n, (b+1)/n), the last one closed.

    The index is ``floor(v * n_bins)`` clipped to ``n_bins - 1`` so that a value of exactly 1.0
    falls in the last bin. torchmetrics instead puts 1.0 in a hidden extra bin of its own, which
    changes the ECE whenever saturated predictions share the top bin with others.
    A value within one float64 rounding step of an inner edge may land on either side of it.
    """
    n_bins = _check_n_bins(n_bins)
    v = _as_numpy(values, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("values to bin contain NaN or inf")
    if np.any(v < 0) or np.any(v > 1 + _PROB_TOL):
        raise ValueError(
            f"values to bin must lie in [0, 1], got min {v.min():.6g} and max {v.max():.6g}"
        )
    return np.clip(np.floor(v * n_bins).astype(np.int64), 0, n_bins - 1)


@dataclass(frozen=True)
class ReliabilityBins:
    """Per-bin statistics of a reliability diagram; NaN marks the mean of an empty bin."""

    counts: np.ndarray
    mean_confidence: np.ndarray
    accuracy: np.ndarray
    edges: np.ndarray

    @property
    def n_bins(self) -> int:
        """Number of bins."""
        return int(self.counts.shape[0])

    def gaps(self) -> np.ndarray:
        """Per-bin |accuracy - mean confidence| (NaN for empty bins)."""
        return np.abs(self.accuracy - self.mean_confidence)

    def expected_gap(self) -> float:
        """Count-weighted mean gap over the bins: the ECE of these bins."""
        total = self.counts.sum()
        nonempty = self.counts > 0
        return float(np.sum(self.counts[nonempty] * self.gaps()[nonempty]) / total)

    def max_gap(self) -> float:
        """Largest gap over the non-empty bins: the MCE of these bins."""
        return float(np.max(self.gaps()[self.counts > 0]))

    def mean_gap(self) -> float:
        """Unweighted mean gap over the non-empty bins: netcal's average calibration error."""
        return float(np.mean(self.gaps()[self.counts > 0]))


def reliability_bins(confidences: Any, correct: Any, n_bins: int = 10) -> ReliabilityBins:
    """Bin ``confidences`` into equal-width bins and average them and ``correct`` per bin."""
    conf = _as_numpy(confidences, dtype=np.float64)
    hit = _as_numpy(correct, dtype=np.float64)
    if conf.ndim != 1 or hit.shape != conf.shape:
        raise ValueError(
            f"confidences and correct must be 1-D of equal length, got {conf.shape} and {hit.shape}"
        )
    if conf.size == 0:
        raise ValueError("reliability_bins needs at least one value")
    if np.any((hit != 0) & (hit != 1)):
        raise ValueError("correct must contain only 0/1 (or booleans)")
    n_bins = _check_n_bins(n_bins)
    idx = bin_indices(conf, n_bins)
    counts = np.bincount(idx, minlength=n_bins)
    conf_sum = np.bincount(idx, weights=conf, minlength=n_bins)
    hit_sum = np.bincount(idx, weights=hit, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf = np.where(counts > 0, conf_sum / counts, np.nan)
        acc = np.where(counts > 0, hit_sum / counts, np.nan)
    return ReliabilityBins(
        counts=counts.astype(np.int64),
        mean_confidence=mean_conf,
        accuracy=acc,
        edges=np.linspace(0.0, 1.0, n_bins + 1),
    )


# Private versions take already-validated arrays so that calibration_report validates once.


def _top_label(
    p: np.ndarray, y: np.ndarray, predictions: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    # argmax takes the first of tied options, the same rule as the accuracy metric. Methods
    # that state their answer separately (verbalised or layer-agreement confidence) pass it.
    pred = np.argmax(p, axis=1) if predictions is None else predictions
    return p[np.arange(p.shape[0]), pred], (pred == y)


def top_label_pairs(
    probs: Any, labels: Any, predictions: Any = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validated (probs, labels) and the top-label (confidence, correct) pairs, the answer
    being the argmax or the stated `predictions`."""
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y, _validate_predictions(predictions, p))
    return p, y, conf, hit


def brier_rows(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each question's Brier term, sum_k (p_k - onehot_k)^2 (validated inputs)."""
    return _brier_rows(p, y)


def nll_rows(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each question's -log max(p_y, eps), the terms of `nll` (validated inputs)."""
    return -np.log(np.maximum(p[np.arange(p.shape[0]), y], _NLL_EPS))


def _validate_predictions(predictions: Any, p: np.ndarray) -> np.ndarray | None:
    if predictions is None:
        return None
    pred = _as_numpy(predictions).astype(np.int64)
    if pred.shape != (p.shape[0],) or np.any((pred < 0) | (pred >= p.shape[1])):
        raise ValueError(f"predictions must be (N,) option indices in [0, {p.shape[1]})")
    return pred


def _classwise_bins(p: np.ndarray, y: np.ndarray, n_bins: int) -> list[ReliabilityBins]:
    return [reliability_bins(p[:, j], y == j, n_bins) for j in range(p.shape[1])]


def _ace(p: np.ndarray, y: np.ndarray, n_ranges: int) -> float:
    n_ranges = _check_n_bins(n_ranges, "n_ranges")
    gaps = []
    for j in range(p.shape[1]):
        # Stable sort keeps tied probabilities in input order, so the result is deterministic.
        order = np.argsort(p[:, j], kind="stable")
        pj = p[order, j]
        hit = (y[order] == j).astype(np.float64)
        for chunk in np.array_split(np.arange(pj.shape[0]), n_ranges):
            if chunk.size:  # fewer examples than ranges leaves some ranges empty
                gaps.append(abs(hit[chunk].mean() - pj[chunk].mean()))
    return float(np.mean(gaps))


def _brier_rows(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    diff = p.copy()
    diff[np.arange(p.shape[0]), y] -= 1.0
    return np.sum(diff * diff, axis=1)


def _nll(p: np.ndarray, y: np.ndarray, eps: float) -> float:
    # eps keeps one confidently wrong answer from making the mean infinite.
    return float(np.mean(-np.log(np.maximum(p[np.arange(p.shape[0]), y], eps))))


def confidence_ece(probs: Any, labels: Any, n_bins: int = 10) -> float:
    """Top-label expected calibration error: sum_b (n_b / N) |acc_b - conf_b|."""
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y)
    return reliability_bins(conf, hit, n_bins).expected_gap()


def classwise_ece(probs: Any, labels: Any, n_bins: int = 10) -> float:
    """Class-wise ECE: (1/K) sum_j sum_b (n_jb / N) |freq_jb - mean p_jb|, binning p_j vs y == j."""
    p, y = validate_inputs(probs, labels)
    return float(np.mean([b.expected_gap() for b in _classwise_bins(p, y, n_bins)]))


def maximum_calibration_error(probs: Any, labels: Any, n_bins: int = 10) -> float:
    """Top-label maximum calibration error: max over non-empty bins of |acc_b - conf_b|."""
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y)
    return reliability_bins(conf, hit, n_bins).max_gap()


def adaptive_calibration_error(probs: Any, labels: Any, n_ranges: int = 10) -> float:
    """Adaptive calibration error (ACE), Nixon et al. 2019 "Measuring Calibration in Deep Learning".

    For every class j the N predicted p_j are sorted and split into ``n_ranges`` ranges of equal
    mass (``np.array_split``, so sizes differ by at most one); ACE is the unweighted mean of
    |observed frequency of y == j - mean p_j| over all classes and ranges:
    ACE = 1/(K R) sum_j sum_r |freq_jr - conf_jr|. This is the ACE without the probability
    threshold of TACE. Ranges left empty when N < n_ranges are skipped.
    """
    p, y = validate_inputs(probs, labels)
    return _ace(p, y, n_ranges)


def average_calibration_error(probs: Any, labels: Any, n_bins: int = 10) -> float:
    """Average calibration error, netcal's `ACE` (the metric DACA's code reports as ACE).

    Top-label, the same equal-width bins as conf-ECE, but every non-empty bin counts once
    whatever its size: (1 / |B+|) sum_{b in B+} |acc_b - conf_b| over the non-empty bins B+.
    Not to be confused with `adaptive_calibration_error` (Nixon et al.), the report's `ace`.
    """
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y)
    return reliability_bins(conf, hit, n_bins).mean_gap()


def brier_score(probs: Any, labels: Any) -> float:
    """Multiclass Brier score: mean over examples of sum_k (p_k - onehot_k)^2."""
    p, y = validate_inputs(probs, labels)
    return float(np.mean(_brier_rows(p, y)))


def negative_log_likelihood(probs: Any, labels: Any, eps: float = _NLL_EPS) -> float:
    """Mean negative log-likelihood of the true option: mean of -log(max(p_y, eps))."""
    p, y = validate_inputs(probs, labels)
    return _nll(p, y, eps)


def equal_mass_ranges(confidences: Any, correct: Any, n_ranges: int = 10):
    """Top-label pairs sorted by confidence (stable) and split into `n_ranges` ranges of equal
    mass (`np.array_split`, sizes differ by at most one; empty ranges dropped): per range its
    size, mean confidence and accuracy."""
    conf = _as_numpy(confidences, dtype=np.float64)
    hit = _as_numpy(correct, dtype=np.float64)
    order = np.argsort(conf, kind="stable")
    chunks = [c for c in np.array_split(order, _check_n_bins(n_ranges, "n_ranges")) if c.size]
    sizes = np.array([c.size for c in chunks], dtype=np.float64)
    return (
        sizes,
        np.array([conf[c].mean() for c in chunks]),
        np.array([hit[c].mean() for c in chunks]),
    )


def _equal_mass_ece(conf: np.ndarray, hit: np.ndarray, n_ranges: int) -> float:
    sizes, mean_conf, acc = equal_mass_ranges(conf, hit, n_ranges)
    return float(np.sum(sizes * np.abs(acc - mean_conf)) / sizes.sum())


def _debiased_squared_ce(conf: np.ndarray, hit: np.ndarray, n_ranges: int) -> float:
    sizes, mean_conf, acc = equal_mass_ranges(conf, hit, n_ranges)
    # A range's squared gap overstates the true one by about the variance of its accuracy,
    # acc (1 - acc) / (n - 1) (Kumar et al. 2019); a range of one answer has no such estimate
    # and adds nothing.
    many = sizes > 1
    terms = (acc - mean_conf) ** 2 - acc * (1 - acc) / np.where(many, sizes - 1, 1)
    return float(np.sum(np.where(many, sizes * terms, 0.0)) / sizes.sum())


def equal_mass_ece(probs: Any, labels: Any, n_bins: int = 10, predictions: Any = None) -> float:
    """Top-label ECE over `n_bins` ranges of equal mass (sorted confidences split as ACE
    splits them): sum_r (n_r / N) |acc_r - conf_r|."""
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y, _validate_predictions(predictions, p))
    return _equal_mass_ece(conf, hit, n_bins)


def debiased_calibration_error(
    probs: Any, labels: Any, n_bins: int = 10, predictions: Any = None
) -> float:
    """Kumar et al. 2019's debiased top-label l2 calibration error over equal-mass ranges:
    sqrt(max(0, sum_r (n_r / N) [(acc_r - conf_r)^2 - acc_r (1 - acc_r) / (n_r - 1)])).
    On the RMS scale, so it is at least the l1 error of the same ranges in expectation."""
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y, _validate_predictions(predictions, p))
    return float(np.sqrt(max(0.0, _debiased_squared_ce(conf, hit, n_bins))))


def smooth_ece(probs: Any, labels: Any, predictions: Any = None) -> float:
    """Smooth ECE (Błasiok & Nakkiran 2023) of the top-label pairs, through `relplot`: the
    kernel-smoothed residual E[y - f | f] integrated against the smoothed density, at the
    bandwidth where the two are equal (no bins to choose)."""
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y, _validate_predictions(predictions, p))
    return _smooth_ece(conf, hit)


def _smooth_ece(conf: np.ndarray, hit: np.ndarray) -> float:
    import relplot  # imports pandas and seaborn: only when a smooth ECE is asked for

    return float(relplot.smECE(np.asarray(conf, np.float64), np.asarray(hit, np.float64)))


def accuracy(probs: Any, labels: Any) -> float:
    """Fraction of examples whose argmax option (first on ties) is the label."""
    p, y = validate_inputs(probs, labels)
    return float(np.mean(_top_label(p, y)[1]))


def calibration_report(
    probs: Any, labels: Any, n_bins: int = 10, predictions: Any = None
) -> dict[str, float]:
    """All metrics at once; ``n_bins`` is also the number of ACE and equal-mass ranges, ``n``
    is an int.

    ``ace`` is the adaptive calibration error (Nixon et al.), ``avg_ce`` netcal's average
    calibration error, ``ece_em`` / ``rmsce_debiased`` / ``smece`` the equal-mass, debiased
    and smooth top-label errors, ``auroc`` / ``aurc`` / ``sel_acc_80`` the ranking metrics
    (metrics/ranking.py). ``predictions`` (N,) overrides the argmax as the answer for every
    top-label metric (methods whose confidence belongs to a stated answer); ``cw_ece``,
    ``ace``, ``brier`` and ``nll`` read ``probs``.
    """
    p, y = validate_inputs(probs, labels)
    conf, hit = _top_label(p, y, _validate_predictions(predictions, p))
    top = reliability_bins(conf, hit, n_bins)
    return {
        "accuracy": float(np.mean(hit)),
        "conf_ece": top.expected_gap(),
        "cw_ece": float(np.mean([b.expected_gap() for b in _classwise_bins(p, y, n_bins)])),
        "mce": top.max_gap(),
        "ace": _ace(p, y, n_bins),
        "avg_ce": top.mean_gap(),
        "brier": float(np.mean(_brier_rows(p, y))),
        "nll": _nll(p, y, _NLL_EPS),
        "ece_em": _equal_mass_ece(conf, hit, n_bins),
        "rmsce_debiased": float(np.sqrt(max(0.0, _debiased_squared_ce(conf, hit, n_bins)))),
        "smece": _smooth_ece(conf, hit),
        "auroc": auroc(conf, hit),
        "aurc": aurc(conf, hit),
        "sel_acc_80": selective_accuracy(conf, hit, SELECTIVE_COVERAGE),
        "mean_confidence": float(np.mean(conf)),
        "n": int(p.shape[0]),
    }
