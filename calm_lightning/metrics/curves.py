"""CALM's outer-step curves (residual, relative residual, lambda, entropy, g, head) as one PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from calm_lightning.runtime.run_record import atomic_replace

# (series key, panel title); a key missing from the history leaves its panel out.
PANELS = (
    ("q", "residual q = g(θ) − g(θ̃)"),
    ("q_rel", "q / g (relative inner drop)"),
    ("lambda", "λ (BOME multiplier)"),
    ("entropy", "upper level: held-out entropy"),
    ("g", "lower loss g(α, θ)"),
    ("d_mean", "head: mean of d (± std)"),
)


def plot_calm_curves(history: Sequence[dict[str, float]], path: str | Path) -> Path:
    """Write one panel per series over the outer steps; returns the path."""
    panels = [(k, t) for k, t in PANELS if any(k in h for h in history)]
    fig = Figure(figsize=(4.0 * min(3, len(panels)), 3.0 * ((len(panels) + 2) // 3)))
    FigureCanvasAgg(fig)
    steps = list(range(1, len(history) + 1))
    for index, (key, title) in enumerate(panels, start=1):
        ax = fig.add_subplot((len(panels) + 2) // 3, min(3, len(panels)), index)
        values = [h.get(key, float("nan")) for h in history]
        ax.plot(steps, values, marker=".", color="tab:blue")
        if key == "d_mean" and any("d_std" in h for h in history):
            spread = [h.get("d_std", 0.0) for h in history]
            low = [v - s for v, s in zip(values, spread, strict=True)]
            high = [v + s for v, s in zip(values, spread, strict=True)]
            ax.fill_between(steps, low, high, color="tab:blue", alpha=0.2)
        if key in ("q", "q_rel"):
            ax.axhline(0.0, color="grey", linewidth=0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("outer step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    path = Path(path)
    with atomic_replace(path) as tmp:  # as every file of a run record
        fig.savefig(tmp, dpi=110, format="png")
    return path
