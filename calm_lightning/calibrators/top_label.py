"""Top-label recalibration maps, pure functions on (confidence, correct) pairs: histogram
binning (Zadrozny & Elkan 2001) over equal-mass bins and isotonic regression (scikit-learn's
`IsotonicRegression`), the post-hoc baselines `hb` and `isotonic` (methods/binning.py).

Top-label (Gupta & Ramdas 2022): the map is fitted on the confidence of the predicted answer
and whether it was right, and at test time replaces that confidence; the answer stays the
argmax, so accuracy never changes. `recalibrate` puts the new confidence on the answer and
scales the other options to fill the rest of the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TopLabelMap:
    """A fitted map from a confidence to a recalibrated one.

    `histogram`: `x` holds the inner bin edges and `y` each bin's accuracy on the fit data (a
    confidence equal to an edge belongs to the bin below it); `isotonic`: `x` and `y` are the
    fitted step function's thresholds, interpolated linearly between them and clipped outside,
    as scikit-learn's `IsotonicRegression.predict` does."""

    kind: str
    x: np.ndarray
    y: np.ndarray
    n: int

    def __call__(self, confidences) -> np.ndarray:
        conf = np.asarray(confidences, dtype=np.float64)
        if self.kind == "histogram":
            return self.y[np.searchsorted(self.x, conf, side="left")]
        return np.interp(conf, self.x, self.y)

    def record(self) -> dict:
        """What metrics.json keeps (`posthoc`) and calibration/ saves."""
        return {"map": self.kind, "x": self.x.tolist(), "y": self.y.tolist(), "n": self.n}


def _pairs(confidences, correct) -> tuple[np.ndarray, np.ndarray]:
    conf = np.asarray(confidences, dtype=np.float64).ravel()
    hit = np.asarray(correct, dtype=np.float64).ravel()
    if conf.size == 0 or hit.shape != conf.shape:
        raise ValueError(f"need as many confidences as answers (> 0): {conf.size}, {hit.size}")
    return conf, hit


def fit_histogram_binning(confidences, correct, n_bins: int = 10) -> TopLabelMap:
    """Equal-mass bins (edges at the fit confidences' quantiles, as scikit-learn's
    `calibration_curve(strategy="quantile")` draws them); each bin maps to its accuracy, a bin
    no fit confidence fell in to the overall accuracy."""
    conf, hit = _pairs(confidences, correct)
    edges = np.percentile(conf, np.linspace(0, 100, n_bins + 1))[1:-1]
    bins = np.searchsorted(edges, conf, side="left")
    count = np.bincount(bins, minlength=n_bins)
    right = np.bincount(bins, weights=hit, minlength=n_bins)
    value = np.where(count > 0, right / np.maximum(count, 1), hit.mean())
    return TopLabelMap("histogram", edges, value, int(conf.size))


def fit_isotonic(confidences, correct) -> TopLabelMap:
    """The non-decreasing step function of confidence closest to correctness in squared error
    (pool-adjacent-violators, scikit-learn), bounded to [0, 1]."""
    from sklearn.isotonic import IsotonicRegression

    conf, hit = _pairs(confidences, correct)
    fit = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(conf, hit)
    return TopLabelMap("isotonic", fit.X_thresholds_, fit.y_thresholds_, int(conf.size))


def recalibrate(probs: np.ndarray, mapping: TopLabelMap) -> tuple[np.ndarray, np.ndarray]:
    """(N, K) rows with the argmax's probability replaced by `mapping` of it and the other
    options scaled to fill the rest (evenly when the argmax held all of it), and the argmax
    itself: the stated answer, which the new confidence belongs to."""
    probs = np.asarray(probs, dtype=np.float64)
    rows, k = np.arange(probs.shape[0]), probs.shape[1]
    answer = probs.argmax(1)
    old = probs[rows, answer]
    new = np.clip(mapping(old), 0.0, 1.0)
    rest = probs.copy()
    rest[rows, answer] = 0.0
    spare = 1.0 - old
    scaled = rest * np.divide(1.0 - new, spare, out=np.zeros_like(spare), where=spare > 0)[:, None]
    even = np.where(spare > 0, 0.0, (1.0 - new) / (k - 1))
    out = scaled + even[:, None]
    out[rows, answer] = new
    return out, answer
