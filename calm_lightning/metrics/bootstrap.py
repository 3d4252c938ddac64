"""Bootstrap intervals over questions, vectorised: one row's 95 % interval per metric
(metrics.json's `ci95`) and the paired difference of two rows scored on the same questions (the
report's paired comparisons, studies/paired_bootstrap.py). One implementation for all of them.

A resample draws N questions with replacement and is held as a row of counts (how often each
question was drawn), so every metric of B resamples is a few array operations on a (B, N)
matrix instead of B calls: weighted sums for the means and the equal-width bins, and each
resample's sorted sequence, rebuilt from its counts without sorting, for the equal-mass ranges
and the ranking metrics. Intervals are percentile intervals (2.5 and 97.5 % of the resampled
values). The same seed gives the same resamples; two rows compared together see the same
questions drawn. smECE has no vectorised form (relplot searches its bandwidth per call): its
interval reads the first `smece_resamples` resamples only.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from calm_lightning.config_rules import Number
from calm_lightning.metrics.calibration import (
    bin_indices,
    brier_rows,
    nll_rows,
    top_label_pairs,
)
from calm_lightning.metrics.ranking import SELECTIVE_COVERAGE

LEVEL = 0.95
_CHUNK_ELEMENTS = 2_000_000  # resamples x questions held at once (a few tens of MB)

# What a resample gives for (confidence, correct) pairs alone, and with the option vectors.
TOP_LABEL_KEYS = (
    "accuracy",
    "conf_ece",
    "mce",
    "avg_ce",
    "ece_em",
    "rmsce_debiased",
    "auroc",
    "aurc",
    "sel_acc_80",
    "mean_confidence",
)
VECTOR_KEYS = ("cw_ece", "ace", "brier", "nll")
SLOW_KEYS = ("smece",)


@dataclass(frozen=True)
class BootstrapSettings:
    """`evaluation.bootstrap`: resamples, seed, and how many of them smECE's interval reads."""

    resamples: int = 1000
    seed: int = 0
    smece_resamples: int = 200

    rules: ClassVar[dict] = {
        "resamples": Number(minimum=0, integer=True),
        "seed": Number(minimum=0, integer=True),
        "smece_resamples": Number(minimum=0, integer=True),
    }

    @classmethod
    def from_config(cls, node: Mapping | None) -> BootstrapSettings:
        node = dict(node or {})
        return cls(
            **{k: int(node[k]) for k in ("resamples", "seed", "smece_resamples") if k in node}
        )


def resample_counts(n: int, resamples: int, seed: int) -> Iterator[np.ndarray]:
    """Chunks of (b, n) float counts: row r says how often each of the n questions was drawn
    in resample r (rows sum to n)."""
    rng = np.random.default_rng(seed)
    per_chunk = max(1, _CHUNK_ELEMENTS // max(n, 1))
    done = 0
    while done < resamples:
        b = min(per_chunk, resamples - done)
        draws = rng.integers(0, n, size=(b, n)) + n * np.arange(b)[:, None]
        yield np.bincount(draws.ravel(), minlength=b * n).reshape(b, n).astype(np.float64)
        done += b


def _expand(counts: np.ndarray) -> np.ndarray:
    """(B, M) counts of M items in some order (every row summing to the same N) -> (B, N)
    item positions, each repeated as often as drawn: the resample's sorted sequence, without a
    sort."""
    b, m = counts.shape
    return np.repeat(np.tile(np.arange(m), b), counts.astype(np.int64).ravel()).reshape(b, -1)


def _range_starts(n: int, n_ranges: int) -> tuple[np.ndarray, np.ndarray]:
    """Starts and sizes of np.array_split's equal-mass ranges of n sorted items (non-empty)."""
    sizes = np.array([len(c) for c in np.array_split(np.arange(n), n_ranges)])
    sizes = sizes[sizes > 0]
    return np.cumsum(sizes) - sizes, sizes.astype(np.float64)


def _binned(counts: np.ndarray, onehot: np.ndarray, hit: np.ndarray, conf: np.ndarray):
    """Equal-width bins of B resamples: (ECE, MCE, AvgCE), each (B,)."""
    n_bins = onehot.shape[1]
    sums = counts @ np.concatenate([onehot, onehot * hit[:, None], onehot * conf[:, None]], 1)
    size, gap = sums[:, :n_bins], np.abs(sums[:, n_bins : 2 * n_bins] - sums[:, 2 * n_bins :])
    filled = size > 0
    per_bin = np.divide(gap, size, out=np.zeros_like(gap), where=filled)
    ece = gap.sum(1) / counts.sum(1)
    mce = np.where(filled, per_bin, -np.inf).max(1)
    avg = per_bin.sum(1) / filled.sum(1)
    return ece, mce, avg


class _SortedValues:
    """One ordering of the questions (ascending `key`), for equal-mass ranges of resamples."""

    def __init__(self, key: np.ndarray, values: np.ndarray, hit: np.ndarray, n_ranges: int):
        self.order = np.argsort(key, kind="stable")
        self.values, self.hit = values[self.order], hit[self.order]
        self.starts, self.sizes = _range_starts(key.size, n_ranges)

    def ranges(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per resample and range: the mean value and the mean hit, each (B, R)."""
        seq = _expand(counts[:, self.order])
        mean = np.add.reduceat(self.values[seq], self.starts, axis=1) / self.sizes
        acc = np.add.reduceat(self.hit[seq], self.starts, axis=1) / self.sizes
        return mean, acc


class ScoredQuestions:
    """One row's scored questions, ready to be resampled: top-label (confidence, correct)
    pairs and, when given, the option vectors and labels (class-wise metrics, Brier, NLL)."""

    def __init__(
        self,
        confidences: Any,
        correct: Any,
        probs: np.ndarray | None = None,
        labels: np.ndarray | None = None,
        n_bins: int = 10,
    ) -> None:
        self.conf = np.asarray(confidences, dtype=np.float64)
        self.hit = np.asarray(correct, dtype=np.float64)
        self.n, self.n_bins = self.conf.size, n_bins
        self.onehot = np.eye(n_bins)[bin_indices(self.conf, n_bins)]
        self.ascending = _SortedValues(self.conf, self.conf, self.hit, n_bins)
        self._ranking_order()
        self.probs, self.labels = probs, labels
        if probs is not None:
            self.classes = [
                (np.eye(n_bins)[bin_indices(probs[:, j], n_bins)], (labels == j) * 1.0)
                for j in range(probs.shape[1])
            ]
            self.class_sorted = [
                _SortedValues(probs[:, j], probs[:, j], hit, n_bins)
                for j, (_, hit) in enumerate(self.classes)
            ]
            self.brier, self.nll = brier_rows(probs, labels), nll_rows(probs, labels)

    @classmethod
    def from_probs(cls, probs, labels, predictions=None, n_bins: int = 10) -> ScoredQuestions:
        """From (N, K) option probabilities, labels and optional stated answers."""
        p, y, conf, hit = top_label_pairs(probs, labels, predictions)
        return cls(conf, hit, p, y, n_bins)

    def _ranking_order(self) -> None:
        self.desc = np.argsort(-self.conf, kind="stable")
        desc_conf = self.conf[self.desc]
        self.group_starts = np.flatnonzero(np.r_[True, desc_conf[1:] != desc_conf[:-1]])
        self.desc_err = 1.0 - self.hit[self.desc]

    @property
    def keys(self) -> tuple[str, ...]:
        """What `values` gives for this row."""
        return TOP_LABEL_KEYS + (VECTOR_KEYS if self.probs is not None else ())

    def values(self, counts: np.ndarray, keys=None) -> dict[str, np.ndarray]:
        """The vectorised metrics of the resamples `counts` (B, N): key -> (B,); `keys`
        limits the work to the groups they need (None: all)."""
        wanted = set(self.keys if keys is None else keys)
        n = counts.sum(1)
        out = {"accuracy": counts @ self.hit / n, "mean_confidence": counts @ self.conf / n}
        if wanted & {"conf_ece", "mce", "avg_ce"}:
            out["conf_ece"], out["mce"], out["avg_ce"] = _binned(
                counts, self.onehot, self.hit, self.conf
            )
        if wanted & {"ece_em", "rmsce_debiased"}:
            out.update(self._equal_mass(counts, n))
        if wanted & {"auroc", "aurc", "sel_acc_80"}:
            out.update(self._ranking(counts))
        if self.probs is not None and wanted & set(VECTOR_KEYS):
            out.update(self._vector(counts, n))
        return out

    def _equal_mass(self, counts: np.ndarray, n: np.ndarray) -> dict[str, np.ndarray]:
        mean_conf, acc = self.ascending.ranges(counts)
        sizes = self.ascending.sizes
        many = sizes > 1
        variance = acc * (1 - acc) / np.where(many, sizes - 1, 1)
        squared = np.where(many, sizes * ((acc - mean_conf) ** 2 - variance), 0.0).sum(1) / n
        return {
            "ece_em": (sizes * np.abs(acc - mean_conf)).sum(1) / n,
            "rmsce_debiased": np.sqrt(np.maximum(squared, 0.0)),
        }

    def _ranking(self, counts: np.ndarray) -> dict[str, np.ndarray]:
        """AUROC, AURC and selective accuracy of resamples (ties as in metrics/ranking.py)."""
        ordered = counts[:, self.desc]
        size = np.add.reduceat(ordered, self.group_starts, axis=1)  # (B, U) per tied group
        wrong = np.add.reduceat(ordered * self.desc_err, self.group_starts, axis=1)
        right = size - wrong
        n_wrong, n_right = wrong.sum(1), right.sum(1)
        wrong_below = n_wrong[:, None] - np.cumsum(wrong, 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            auroc = (right * (wrong_below + 0.5 * wrong)).sum(1) / (n_right * n_wrong)
        group = _expand(size)  # each position's tied group, most confident first
        start = np.take_along_axis(np.cumsum(size, 1) - size, group, 1)
        before = np.take_along_axis(np.cumsum(wrong, 1) - wrong, group, 1)
        rate = np.take_along_axis(wrong / np.where(size > 0, size, 1), group, 1)
        taken = np.arange(1, counts.shape[1] + 1)
        risk = (before + (taken - start) * rate) / taken
        k = max(1, math.ceil(SELECTIVE_COVERAGE * counts.shape[1] - 1e-9))
        return {"auroc": auroc, "aurc": risk.mean(1), "sel_acc_80": 1.0 - risk[:, k - 1]}

    def _vector(self, counts: np.ndarray, n: np.ndarray) -> dict[str, np.ndarray]:
        """cw-ECE, ACE, Brier and NLL of resamples."""
        cw, ace = [], []
        for j, ((onehot, hit), ordered) in enumerate(
            zip(self.classes, self.class_sorted, strict=True)
        ):
            cw.append(_binned(counts, onehot, hit, self.probs[:, j])[0])
            mean_p, freq = ordered.ranges(counts)
            ace.append(np.abs(freq - mean_p).mean(1))
        return {
            "cw_ece": np.mean(cw, 0),
            "ace": np.mean(ace, 0),
            "brier": counts @ self.brier / n,
            "nll": counts @ self.nll / n,
        }

    def smece(self, counts: np.ndarray) -> np.ndarray:
        """smECE of each resample (one relplot call each)."""
        from calm_lightning.metrics.calibration import _smooth_ece

        out = []
        for row in counts:
            drawn = np.repeat(np.arange(self.n), row.astype(np.int64))
            out.append(_smooth_ece(self.conf[drawn], self.hit[drawn]))
        return np.array(out)

    def point(self, keys: tuple[str, ...] | None = None) -> dict[str, float]:
        """The metrics of the questions as scored (the identity resample)."""
        values = self.values(np.ones((1, self.n)))
        out = {k: float(v[0]) for k, v in values.items() if keys is None or k in keys}
        if keys is not None and "smece" in keys:
            out["smece"] = float(self.smece(np.ones((1, self.n)))[0])
        return out


def percentile_interval(samples: np.ndarray) -> list[float | None]:
    """The percentile interval; None ends where no resample defines the metric."""
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return [None, None]
    tail = 100 * (1 - LEVEL) / 2
    low, high = np.percentile(samples, [tail, 100 - tail])
    return [float(low), float(high)]


def resampled_values(rows: list[ScoredQuestions], keys, settings: BootstrapSettings):
    """Per row, key -> (resamples,) values, the rows (the same questions) resampled together."""
    fast = [k for k in keys if k not in SLOW_KEYS]
    found: list[dict[str, list]] = [{k: [] for k in keys} for _ in rows]
    smece_left = settings.smece_resamples if "smece" in keys else 0
    for counts in resample_counts(rows[0].n, settings.resamples, settings.seed):
        for row, out in zip(rows, found, strict=True):
            values = row.values(counts, fast)
            for k in fast:
                out[k].append(values[k])
            if smece_left > 0:
                out["smece"].append(row.smece(counts[:smece_left]))
        smece_left -= len(counts)
    return [{k: np.concatenate(v) if v else np.empty(0) for k, v in out.items()} for out in found]


def intervals(
    row: ScoredQuestions, settings: BootstrapSettings, keys: tuple[str, ...] | None = None
) -> dict[str, list[float | None]]:
    """metrics.json's `ci95`: key -> [low, high], the bootstrap percentile interval of each
    metric over questions (mean confidence left out: it describes, it does not score)."""
    keys = tuple(k for k in (keys or row.keys + SLOW_KEYS) if k != "mean_confidence")
    if settings.resamples == 0 or row.n == 0:
        return {}
    samples = resampled_values([row], keys, settings)[0]
    return {k: percentile_interval(v) for k, v in samples.items() if v.size}


@dataclass(frozen=True)
class PairedDifference:
    """b - a on the same questions: the point difference, its standard error and 95 %
    percentile interval over the resamples (the same questions drawn for both)."""

    metric: str
    a: float
    b: float
    difference: float
    standard_error: float
    ci95: tuple[float | None, float | None]
    questions: int

    @property
    def excludes_zero(self) -> bool:
        low, high = self.ci95
        return low is not None and (low > 0 or high < 0)


def paired_differences(
    pairs: list[tuple[ScoredQuestions, ScoredQuestions]],
    keys: tuple[str, ...],
    settings: BootstrapSettings,
) -> dict[str, PairedDifference]:
    """b - a per metric, averaged over `pairs` (one pair per seed: each resampled on its own
    questions, the same replicate index averaged); each pair's rows must hold the same
    questions in the same order."""
    for a, b in pairs:
        if a.n != b.n:
            raise ValueError(f"paired rows must score the same questions ({a.n} vs {b.n})")
    per_pair = []
    for i, (a, b) in enumerate(pairs):
        seeded = BootstrapSettings(settings.resamples, settings.seed + i, settings.smece_resamples)
        sa, sb = resampled_values([a, b], keys, seeded)
        per_pair.append((a.point(keys), b.point(keys), sa, sb))
    out = {}
    for k in keys:
        a_val = float(np.mean([pa[k] for pa, *_ in per_pair]))
        b_val = float(np.mean([pb[k] for _, pb, *_ in per_pair]))
        diffs = np.mean([sb[k] - sa[k] for *_, sa, sb in per_pair], 0)
        finite = diffs[np.isfinite(diffs)]
        se = float(np.std(finite, ddof=1)) if finite.size > 1 else math.nan
        low, high = percentile_interval(diffs)
        out[k] = PairedDifference(
            k, a_val, b_val, b_val - a_val, se, (low, high), sum(a.n for a, _ in pairs)
        )
    return out
