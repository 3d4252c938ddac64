"""Step three of a report: write what the selection chose. `markdown_tables` renders one
paper-style table per (model, setting) with the best value per column in bold; `write_report`
writes `report.md` (tables, selected hyper-parameters, failed runs), `results.csv` (every run),
`selected.csv` (every choice, mean and std), `retention.csv` and the retention tables when runs
measured retention (reporting/retention_table.py) and, via `reliability_grid`, one figure of
the chosen runs' reliability diagrams.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

from calm_lightning.metrics.names import BY_KEY, report_metrics, results_csv_keys
from calm_lightning.reporting.collect import Run
from calm_lightning.reporting.retention_table import (
    retention_markdown,
    retention_rows,
    write_retention_csv,
)
from calm_lightning.reporting.selection import (
    Choice,
    calibration_key,
    method_order,
    select,
    table_positions,
)
from calm_lightning.runtime.run_record import RELIABILITY_FILE


def _cell(choice: Choice, key: str, bold: bool) -> str:
    if key not in choice.mean:  # runs written before this metric existed
        return "-"
    value, spread = choice.mean[key], choice.std[key]
    text = f"{100 * value:.2f}%" if key == "accuracy" else f"{value:.4f}"
    if choice.n_seeds > 1:
        text += f" ± {100 * spread:.2f}" if key == "accuracy" else f" ± {spread:.4f}"
    if not choice.feasible:
        text += " †"
    return f"**{text}**" if bold else text


def markdown_tables(choices: list[Choice]) -> str:
    by_table = defaultdict(list)
    for choice in choices:
        by_table[(choice.model, choice.setting)].append(choice)
    positions = table_positions(choices)
    parts = []
    for (model, setting), rows in sorted(by_table.items()):
        # Only the metrics some row reports (MCQA and open-ended QA report different ones).
        columns = [m for m in report_metrics() if any(m.key in row.mean for row in rows)]
        best = {}
        for metric in columns:
            worst = np.inf if metric.better == "lower" else -np.inf
            pick = min if metric.better == "lower" else max
            best[metric.key] = pick(rows, key=lambda c, k=metric.key, w=worst: c.mean.get(k, w))
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


def write_report(
    runs: list[Run], out: str | Path, min_accuracy_ratio: float = 0.8, collection=None
) -> dict:
    """Write report.md, results.csv, selected.csv, retention.csv (when runs measured
    retention) and reliability_grid.png under `out`. `collection` (reporting/collect.py's
    `collect`): also say how complete each sweep is, what could not be read and which job
    was found twice, and flag selections made from an incomplete sweep."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    choices = select(runs, min_accuracy_ratio)
    failed = [r for r in runs if r.error]
    incomplete = _incomplete_choices(choices, collection)
    lines = _report_lines(runs, choices, failed, min_accuracy_ratio, incomplete)
    if collection is not None:
        lines += completeness_lines(collection)
    retention = retention_rows(choices, runs)
    if retention:
        lines += ["", retention_markdown(retention)]
        write_retention_csv(retention, out / "retention.csv")
    if failed:
        lines += ["", "## Failed or unfinished runs", ""]
        lines += [f"- `{r.path}`: {r.error}" for r in failed]
    markdown = "\n".join(lines) + "\n"
    (out / "report.md").write_text(markdown)
    _write_results_csv(runs, out / "results.csv")
    _write_selected_csv(choices, out / "selected.csv")
    grid = reliability_grid(choices, out / "reliability_grid.png")
    return {
        "choices": choices,
        "incomplete": incomplete,
        "failed": failed,
        "grid": grid,
        "markdown": markdown,
        "retention": bool(retention),
    }


def _incomplete_choices(choices: list[Choice], collection) -> dict[int, str]:
    """choice index -> why its selection may change: a sweep its runs came from has jobs that
    did not finish (failed, killed, never started, unreadable)."""
    out = {}
    for i, choice in enumerate(choices):
        for sweep in getattr(collection, "sweeps", []):
            mine = any(sweep.folder in run.path.parents for run in choice.runs)
            if mine and not sweep.complete:
                out[i] = sweep.line()
    return out


def completeness_lines(collection) -> list[str]:
    """The sweeps' "N of M finished", then each unfinished, failed, unreadable, never-started
    job and each job found twice."""
    lines = ["", "## Completeness", ""]
    for sweep in collection.sweeps:
        lines.append(f"- {sweep.line()}")
        lines += [f"  - never started: `{job}`" for job in sweep.never_started]
    lines += [f"- unreadable, left out: {why}" for why in collection.unreadable.values()]
    lines += [
        f"- the same job twice, counted once: `{kept}` (kept), `{extra}`"
        for kept, extra in collection.duplicates
    ]
    return lines if len(lines) > 3 else []


def _report_lines(
    runs: list[Run],
    choices: list[Choice],
    failed: list[Run],
    min_accuracy_ratio: float,
    incomplete: dict[int, str] | None = None,
) -> list[str]:
    """report.md's header, the tables and the selected hyper-parameters."""
    lines = [
        "# Results",
        "",
        f"Selection: lowest conf-ECE (Sem-ECE for open-ended QA) among runs with accuracy > "
        f"{min_accuracy_ratio:.0%} of "
        f"the base model's; {sum(1 for r in runs if r.metrics)} finished runs, "
        f"{len(failed)} failed or unfinished.",
        "",
        markdown_tables(choices),
        "## Selected hyper-parameters",
        "",
        f"| model | setting | method | hyper-parameters | selected on | value | "
        f"{BY_KEY['accuracy'].column} |",
        "|---|---|---|---|---|---|---|",
    ]
    incomplete = incomplete or {}
    for i, c in enumerate(choices):
        params = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in c.params.items()) or "-"
        key = calibration_key(c.mean)
        mark = " ‡" if i in incomplete else ""
        lines.append(
            f"| {c.model} | {c.setting} | {c.method}{mark} | {params} | {key} | "
            f"{c.mean[key]:.4f} | {100 * c.mean['accuracy']:.2f}% |"
        )
    if incomplete:
        lines += ["", "‡ selected from an incomplete sweep; the choice may change:"]
        lines += [f"- {why}" for why in sorted(set(incomplete.values()))]
    return lines


def _write_results_csv(runs: list[Run], path: Path) -> None:
    """One row per run: its hyper-parameters, status and every metric."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "model",
                "setting",
                "method",
                "seed",
                "params",
                "path",
                "status",
                *results_csv_keys(),
            ]
        )
        for r in runs:
            m = r.metrics or {}
            writer.writerow(
                [
                    r.model,
                    r.setting,
                    r.method,
                    r.seed,
                    json.dumps(r.params, default=str),
                    str(r.path),
                    "ok" if r.metrics else f"failed: {r.error}",
                    *[m.get(k, "") for k in results_csv_keys()],
                ]
            )


def _write_selected_csv(choices: list[Choice], path: Path) -> None:
    """One row per choice: mean and std of every reported metric over its seeds."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "model",
                "setting",
                "method",
                "params",
                "n_seeds",
                "feasible",
                *[f"{m.key}{suffix}" for m in report_metrics() for suffix in ("", "_std")],
            ]
        )
        for c in choices:
            writer.writerow(
                [
                    c.model,
                    c.setting,
                    c.method,
                    json.dumps(c.params, default=str),
                    c.n_seeds,
                    c.feasible,
                    *[
                        value
                        for m in report_metrics()
                        for value in (c.mean.get(m.key, ""), c.std.get(m.key, ""))
                    ],
                ]
            )


def reliability_grid(choices: list[Choice], path: Path) -> Path | None:
    """One row per (model, setting), one panel per selected method (its first seed's diagram)."""
    import matplotlib.image as mpimg
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    positions = table_positions(choices)
    rows = defaultdict(list)
    for c in choices:
        image = c.runs[0].path / RELIABILITY_FILE
        if image.is_file():
            rows[(c.model, c.setting)].append((c.method, image))
    if not rows:
        return None
    n_cols = max(len(v) for v in rows.values())
    fig = Figure(figsize=(5.5 * n_cols, 2.9 * len(rows)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    for i, (key, panels) in enumerate(sorted(rows.items())):
        panels.sort(key=lambda p: method_order(p[0], positions))
        for j in range(n_cols):
            ax = fig.add_subplot(len(rows), n_cols, i * n_cols + j + 1)
            ax.axis("off")
            if j < len(panels):
                ax.imshow(mpimg.imread(panels[j][1]))
                ax.set_title(f"{key[0]} / {key[1]}: {panels[j][0]}", fontsize=9)
    fig.savefig(path)
    return path
