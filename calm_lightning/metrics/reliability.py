"""Reliability diagrams (top-label and class-wise) written to PNG without pyplot global state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from calm_lightning.metrics.calibration import (
    classwise_ece,
    reliability_bins,
    validate_inputs,
)
from calm_lightning.runtime.run_record import atomic_replace

__all__ = ["option_letter", "plot_confidence_reliability", "plot_reliability_diagram"]


def option_letter(j: int) -> str:
    """Letter of answer option ``j`` (A, B, ...), falling back to the index past Z."""
    return chr(ord("A") + j) if 0 <= j < 26 else str(j)


def _draw_top_label(ax_rel, ax_hist, top, title: str, legend: str, xlabel: str) -> None:
    """Accuracy bars with the gap to mean confidence per bin, and the bin counts below."""
    width = 1.0 / top.n_bins
    left = top.edges[:-1]
    full = top.counts > 0
    ax_rel.bar(
        left[full],
        top.accuracy[full],
        width=width,
        align="edge",
        color="tab:blue",
        edgecolor="black",
        linewidth=0.6,
        label="accuracy",
    )
    # The shaded gap runs from the bar top to the mean confidence, so it shows the sign too.
    gap_bottom = np.minimum(top.accuracy[full], top.mean_confidence[full])
    gap_height = np.abs(top.accuracy[full] - top.mean_confidence[full])
    ax_rel.bar(
        left[full],
        gap_height,
        bottom=gap_bottom,
        width=width,
        align="edge",
        color="tab:red",
        alpha=0.3,
        edgecolor="tab:red",
        hatch="//",
        label="gap to confidence",
    )
    ax_rel.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
    ax_rel.plot([], [], " ", label=legend)
    ax_rel.set_xlim(0, 1)
    ax_rel.set_ylim(0, 1)
    ax_rel.set_ylabel("accuracy")
    ax_rel.set_title(title)
    ax_rel.legend(loc="upper left", fontsize=8)
    ax_rel.tick_params(labelbottom=False)

    ax_hist.bar(
        left,
        top.counts,
        width=width,
        align="edge",
        color="tab:gray",
        edgecolor="black",
        linewidth=0.6,
    )
    ax_hist.set_xlabel(xlabel)
    ax_hist.set_ylabel("count")


def _save(fig: Figure, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    out = Path(path)
    with atomic_replace(out) as tmp:  # as every file of a run record
        fig.savefig(tmp, format="png", dpi=120)
    return out


def plot_reliability_diagram(
    probs: Any,
    labels: Any,
    path: str | Path,
    title: str = "",
    n_bins: int = 10,
    predictions: Any = None,
) -> Path:
    """Write a top-label and a class-wise reliability diagram side by side to ``path`` (PNG).

    ``predictions`` (stated answers) replaces the argmax in the top-label panel."""
    p, y = validate_inputs(probs, labels)
    k = p.shape[1]
    pred = np.argmax(p, axis=1) if predictions is None else np.asarray(predictions, dtype=int)
    top = reliability_bins(p[np.arange(p.shape[0]), pred], pred == y, n_bins)
    ece = top.expected_gap()
    acc = float(np.mean(pred == y))
    cw = classwise_ece(p, y, n_bins)

    fig = Figure(figsize=(11, 5.5), dpi=120, layout="constrained")
    # Attaching the Agg canvas explicitly keeps savefig independent of the pyplot backend.
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 2, height_ratios=[3, 1])
    ax_rel = fig.add_subplot(grid[0, 0])
    ax_hist = fig.add_subplot(grid[1, 0], sharex=ax_rel)
    ax_cw = fig.add_subplot(grid[:, 1])
    _draw_top_label(
        ax_rel,
        ax_hist,
        top,
        f"Top-label reliability (conf-ECE {ece:.3f}, acc {acc:.3f})",
        f"conf-ECE = {ece:.3f}, acc = {acc:.3f}",
        "confidence (top option probability)",
    )

    for j in range(k):
        bins = reliability_bins(p[:, j], y == j, n_bins)
        keep = bins.counts > 0
        ax_cw.plot(
            bins.mean_confidence[keep],
            bins.accuracy[keep],
            marker="o",
            markersize=4,
            linewidth=1,
            label=option_letter(j),
        )
    ax_cw.plot([0, 1], [0, 1], "k--", linewidth=1)
    ax_cw.set_xlim(0, 1)
    ax_cw.set_ylim(0, 1)
    ax_cw.set_xlabel("mean predicted probability of option")
    ax_cw.set_ylabel("observed frequency of option")
    ax_cw.set_title(f"Class-wise reliability (cw-ECE {cw:.3f})")
    ax_cw.legend(title="option", loc="best", fontsize=8, ncol=1 if k <= 8 else 2)

    return _save(fig, path, title)


def plot_confidence_reliability(
    confidences: Any,
    correct: Any,
    path: str | Path,
    title: str = "",
    n_bins: int = 10,
    metric: str = "Sem-ECE",
    xlabel: str = "confidence (share of samples in the largest answer cluster)",
) -> Path:
    """A top-label reliability diagram from (confidence, correct) pairs, e.g. open-ended QA."""
    top = reliability_bins(confidences, correct, n_bins)
    ece, acc = top.expected_gap(), float(np.mean(np.asarray(correct, dtype=float)))
    fig = Figure(figsize=(6, 5.5), dpi=120, layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, 1, height_ratios=[3, 1])
    ax_rel = fig.add_subplot(grid[0])
    ax_hist = fig.add_subplot(grid[1], sharex=ax_rel)
    label = f"{metric} = {ece:.3f}, acc = {acc:.3f}"
    _draw_top_label(
        ax_rel, ax_hist, top, f"Reliability ({metric} {ece:.3f}, acc {acc:.3f})", label, xlabel
    )
    return _save(fig, path, title)
