"""The report's tables of one selection: the paper-style table per (model, setting), every cell
with its 95 % interval, and the per-source tables of pooled tests.

A cell's interval: one run, the bootstrap percentile interval over its test questions
(metrics.json's `ci95`); several seeds, mean ± the sample standard deviation s (n − 1) and
[lo, hi] = mean ± t(0.975, n − 1) · s / √n, the interval of the mean over seeds.
"""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np

from calm_lightning.metrics.names import BY_KEY, PERCENT, report_metrics
from calm_lightning.reporting.selection import Choice, method_order, table_positions

SOURCE_COLUMNS = ("accuracy", "conf_ece", "sem_ece", "nll", "brier")


def seed_interval(values: list[float]) -> tuple[float, float, list[float | None]]:
    """(mean, sample std, [lo, hi]) of one metric over seeds (the t interval of the mean)."""
    from scipy.stats import t

    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return math.nan, math.nan, [None, None]
    mean = float(np.mean(values))
    if len(values) < 2:
        return mean, 0.0, [None, None]
    std = float(np.std(values, ddof=1))
    half = float(t.ppf(0.975, len(values) - 1)) * std / math.sqrt(len(values))
    return mean, std, [mean - half, mean + half]


def number(key: str, value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{100 * value:.2f}%" if key in PERCENT else f"{value:.4f}"


def bounds(key: str, interval) -> str:
    """` [lo, hi]` (nothing when the interval is unknown)."""
    if not interval or interval[0] is None:
        return ""
    scale, digits = (100, 2) if key in PERCENT else (1, 4)
    return f" [{scale * interval[0]:.{digits}f}, {scale * interval[1]:.{digits}f}]"


def spread_text(key: str, rows: list[dict]) -> str:
    """A cell from one row per seed (each a metrics dict with its own `ci95`)."""
    if len(rows) == 1:
        row = rows[0]
        return number(key, row.get(key)) + bounds(key, (row.get("ci95") or {}).get(key))
    mean, std, interval = seed_interval([r.get(key) for r in rows])
    spread = f"{100 * std:.2f}" if key in PERCENT else f"{std:.4f}"
    return f"{number(key, mean)} ± {spread}{bounds(key, interval)}"


def spread_interval(key: str, rows: list[dict]) -> tuple:
    """[lo, hi] of a cell as numbers for the csv files ("" where unknown)."""
    if len(rows) == 1:
        interval = (rows[0].get("ci95") or {}).get(key) or [None, None]
    else:
        interval = seed_interval([r.get(key) for r in rows])[2]
    return tuple("" if v is None else v for v in interval)


def _cell(choice: Choice, key: str, bold: bool) -> str:
    if key not in choice.mean:  # runs written before this metric existed
        return "-"
    text = spread_text(key, [r.metrics for r in choice.runs])
    if not choice.feasible:
        text += " †"
    return f"**{text}**" if bold else text


def _by_table(choices: list[Choice]) -> dict:
    out = defaultdict(list)
    for choice in choices:
        out[(choice.model, choice.setting)].append(choice)
    return out


def markdown_tables(choices: list[Choice]) -> str:
    """One table per (model, setting), the best value per column in bold."""
    positions = table_positions(choices)
    parts = []
    for (model, setting), rows in sorted(_by_table(choices).items()):
        # Only the metrics some row reports (MCQA and open-ended QA report different ones).
        columns = [m for m in report_metrics() if any(m.key in row.mean for row in rows)]
        best = {}
        for metric in columns:
            worst = np.inf if metric.better == "lower" else -np.inf
            pick = min if metric.better == "lower" else max
            best[metric.key] = pick(rows, key=lambda c, k=metric.key, w=worst: _finite(c, k, w))
        parts.append(f"### {model} / {setting}\n")
        parts.append("| method | " + " | ".join(m.column for m in columns) + " | seeds |")
        parts.append("|---|" + "---|" * (len(columns) + 1))
        for row in sorted(rows, key=lambda c: method_order(c.method, positions)):
            cells = [_cell(row, m.key, row is best[m.key]) for m in columns]
            parts.append(f"| {row.method} | " + " | ".join(cells) + f" | {row.n_seeds} |")
        parts.append("")
    if any(not c.feasible for c in choices):
        parts.append(
            "† no setting of this method kept accuracy above the threshold; the lowest "
            "conf-ECE (Sem-ECE for open-ended QA) among all its runs is shown.\n"
        )
    return "\n".join(parts)


def _finite(choice: Choice, key: str, worst: float) -> float:
    value = choice.mean.get(key, worst)
    return value if math.isfinite(value) else worst


def source_tables(choices: list[Choice]) -> str:
    """Per (model, setting) whose test pools several sources: each method's rows per source and
    their macro average (metrics.json's `by_source`), a source under its minimum marked."""
    positions = table_positions(choices)
    parts = []
    for (model, setting), rows in sorted(_by_table(choices).items()):
        pooled = [c for c in rows if all((r.metrics or {}).get("by_source") for r in c.runs)]
        if not pooled:
            continue
        first = pooled[0].runs[0].metrics["by_source"]
        names = sorted({s for c in pooled for r in c.runs for s in _sources(r)})
        columns = [k for k in SOURCE_COLUMNS if k in first["macro"]]
        parts.append(f"#### {model} / {setting}: per source\n")
        parts.append("| method | source | " + " | ".join(_label(k) for k in columns) + " | n |")
        parts.append("|---|---|" + "---|" * (len(columns) + 1))
        for choice in sorted(pooled, key=lambda c: method_order(c.method, positions)):
            for name in [*names, "macro"]:
                per_seed = [_source_row(r, name) for r in choice.runs]
                if any(row is None for row in per_seed):
                    continue
                few = any(row.get("few_questions") for row in per_seed)
                label = f"{name} (n < {first['min_questions']})" if few else name
                cells = [spread_text(k, per_seed) for k in columns]
                n = "/".join(str(row["n"]) for row in per_seed[:1])
                parts.append(f"| {choice.method} | {label} | " + " | ".join(cells) + f" | {n} |")
        parts.append("")
    if not parts:
        return ""
    note = (
        "Per source: each source's own numbers and their unweighted macro average (a pooled "
        "ECE mixes calibration with the sources' mix); a source with fewer questions than its "
        "mark is kept and marked: its numbers are mostly noise.\n"
    )
    return "\n".join([*parts, note])


def _sources(run) -> dict:
    return run.metrics["by_source"]["sources"]


def _source_row(run, name: str) -> dict | None:
    by_source = run.metrics["by_source"]
    return by_source["macro"] if name == "macro" else by_source["sources"].get(name)


def _label(key: str) -> str:
    metric = BY_KEY.get(key)
    return metric.column if metric else key
