"""Step three of a report: write what the selection chose. `markdown_tables` renders one
paper-style table per (model, setting) with the best value per column in bold; `write_report`
writes `report.md` (tables, selected hyper-parameters, failed runs), `results.csv` (every run),
`selected.csv` (every choice, mean and std), `retention.csv` and the retention tables when runs
measured retention (reporting/retention_table.py) and, via `reliability_grid`, one figure of
the chosen runs' reliability diagrams. Every path a report file names is relative to the
report's folder: a report is shared, the machine's folders (and user name) are not.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from calm_lightning.metrics.bootstrap import BootstrapSettings
from calm_lightning.metrics.names import BY_KEY, report_metrics, results_csv_keys
from calm_lightning.reporting.collect import Run
from calm_lightning.reporting.completeness import relative_path
from calm_lightning.reporting.paired import DEFAULT_REFERENCE, paired_table
from calm_lightning.reporting.retention_table import (
    retention_markdown,
    retention_rows,
    write_retention_csv,
)
from calm_lightning.reporting.selection import (
    SELECT_ON,
    Choice,
    calibration_key,
    method_order,
    select,
    table_positions,
)
from calm_lightning.reporting.tables import markdown_tables, source_tables, spread_interval
from calm_lightning.runtime.run_record import RELIABILITY_FILE


def write_report(
    runs: list[Run],
    out: str | Path,
    min_accuracy_ratio: float = 0.8,
    collection=None,
    select_on: str = "test",
    reference: str = DEFAULT_REFERENCE,
    bootstrap: BootstrapSettings | None = None,
) -> dict:
    """Write report.md, results.csv, selected.csv, retention.csv (when runs measured
    retention) and reliability_grid.png under `out`. `collection` (reporting/collect.py's
    `collect`): also say how complete each sweep is, what could not be read and which job
    was found twice, and flag selections made from an incomplete sweep. `select_on`: test
    (the paper's rule), heldout or both (selection.py); `reference`: the method every other
    is compared with besides base; `bootstrap`: the paired comparisons' resamples."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    splits = SELECT_ON if select_on == "both" else (select_on,)
    selections = {split: select(runs, min_accuracy_ratio, split=split) for split in splits}
    choices = selections[splits[0]]
    failed = [r for r in runs if r.error]
    incomplete = _incomplete_choices(choices, collection, out)
    paired = {"reference": reference, "settings": bootstrap or BootstrapSettings()}
    lines = _report_lines(runs, selections, failed, min_accuracy_ratio, incomplete, paired)
    if collection is not None:
        lines += completeness_lines(collection, out)
    retention = retention_rows(choices, runs)
    if retention:
        lines += ["", retention_markdown(retention)]
        write_retention_csv(retention, out / "retention.csv")
    if failed:
        lines += ["", "## Failed or unfinished runs", ""]
        lines += [f"- `{relative_path(r.path, out)}`: {r.error}" for r in failed]
    markdown = "\n".join(lines) + "\n"
    (out / "report.md").write_text(markdown)
    _write_results_csv(runs, out / "results.csv", out)
    _write_selected_csv([c for chosen in selections.values() for c in chosen], out / "selected.csv")
    grid = reliability_grid(choices, out / "reliability_grid.png")
    return {
        "choices": choices,
        "selections": selections,
        "incomplete": incomplete,
        "failed": failed,
        "grid": grid,
        "markdown": markdown,
        "retention": bool(retention),
    }


def _incomplete_choices(choices: list[Choice], collection, out: Path) -> dict[int, str]:
    """choice index -> why its selection may change: a sweep its runs came from has jobs that
    did not finish (failed, killed, never started, unreadable)."""
    found = {}
    for i, choice in enumerate(choices):
        for sweep in getattr(collection, "sweeps", []):
            mine = any(sweep.folder in run.path.parents for run in choice.runs)
            if mine and not sweep.complete:
                found[i] = sweep.line(out)
    return found


def completeness_lines(collection, out: Path) -> list[str]:
    """The sweeps' "N of M finished", then each unfinished, failed, unreadable, never-started
    job and each job found twice (folders relative to the report's folder `out`)."""
    lines = ["", "## Completeness", ""]
    for sweep in collection.sweeps:
        lines.append(f"- {sweep.line(out)}")
        lines += [f"  - never started: `{job}`" for job in sweep.never_started]
    lines += [
        f"- unreadable, left out: {why.replace(str(folder), relative_path(folder, out))}"
        for folder, why in collection.unreadable.items()
    ]
    lines += [
        f"- the same job twice, counted once: `{relative_path(kept, out)}` (kept), "
        f"`{relative_path(extra, out)}`"
        for kept, extra in collection.duplicates
    ]
    return lines if len(lines) > 3 else []


CAPTIONS = {
    "test": "Selected on the test split (the paper's rule: the setting with the lowest mean "
    "calibration error among those keeping accuracy > {ratio:.0%} of the base model's, chosen "
    "on the very questions it is reported on)",
    "heldout": "Selected on the held-out split (the same rule on each run's held-out metrics, "
    "metrics.json's `heldout`: ID the calibration split, OOD the held-out split the upper level "
    "reads; feasibility against the base runs' held-out accuracy); test metrics shown",
}
SPLIT_NAMES = {"test": "the test split", "heldout": "the held-out split"}
INTERVALS = (
    "[lo, hi]: 95 % interval. One run: bootstrap percentile interval over its test questions "
    "(metrics.json's ci95). n seeds: mean ± s, the sample standard deviation (n − 1), and "
    "[lo, hi] = mean ± t(0.975, n − 1) · s / √n."
)


def _report_lines(
    runs: list[Run],
    selections: dict[str, list[Choice]],
    failed: list[Run],
    min_accuracy_ratio: float,
    incomplete: dict[int, str] | None = None,
    paired: dict | None = None,
) -> list[str]:
    """report.md's header, then per selection its tables, paired differences, per-source
    tables and selected hyper-parameters."""
    paired = paired or {"reference": DEFAULT_REFERENCE, "settings": BootstrapSettings()}
    lines = [
        "# Results",
        "",
        f"Selection: lowest conf-ECE (Sem-ECE for open-ended QA) among runs with accuracy > "
        f"{min_accuracy_ratio:.0%} of "
        f"the base model's, on {' and on '.join(SPLIT_NAMES[s] for s in selections)}; "
        f"{sum(1 for r in runs if r.metrics)} finished runs, "
        f"{len(failed)} failed or unfinished.",
    ]
    for split, choices in selections.items():
        lines += ["", f"## {CAPTIONS[split].format(ratio=min_accuracy_ratio)}", ""]
        lines += [markdown_tables(choices), INTERVALS, ""]
        lines += [paired_table(choices, paired["reference"], paired["settings"])]
        by_source = source_tables(choices)
        lines += [by_source] if by_source else []
        lines += _selected_lines(choices, split, incomplete if split == "test" else {})
    if incomplete:
        lines += ["", "‡ selected from an incomplete sweep; the choice may change:"]
        lines += [f"- {why}" for why in sorted(set(incomplete.values()))]
    return lines


def _selected_lines(choices: list[Choice], split: str, incomplete: dict[int, str]) -> list[str]:
    """The selected hyper-parameters and the value each was chosen by."""
    where = "" if split == "test" else " (held-out)"
    lines = [
        "### Selected hyper-parameters",
        "",
        f"| model | setting | method | hyper-parameters | selected on | value | "
        f"{BY_KEY['accuracy'].column} |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, c in enumerate(choices):
        params = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in c.params.items()) or "-"
        key = calibration_key(c.mean)
        mark = " ‡" if i in incomplete else ""
        value = c.mean[key] if c.criterion is None else c.criterion
        lines.append(
            f"| {c.model} | {c.setting} | {c.method}{mark} | {params} | {key}{where} | "
            f"{value:.4f} | {100 * c.mean['accuracy']:.2f}% |"
        )
    return lines


def _write_results_csv(runs: list[Run], path: Path, out: Path) -> None:
    """One row per run: its hyper-parameters, status and every metric (its folder relative
    to the report's folder `out`)."""
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
                    relative_path(r.path, out),
                    "ok" if r.metrics else f"failed: {r.error}",
                    *[m.get(k, "") for k in results_csv_keys()],
                ]
            )


def _write_selected_csv(choices: list[Choice], path: Path) -> None:
    """One row per choice (per selection): mean, sample std and 95 % interval of every
    reported metric over its seeds (one seed: its bootstrap interval)."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        suffixes = ("", "_std", "_lo", "_hi")
        writer.writerow(
            [
                "model",
                "setting",
                "method",
                "params",
                "n_seeds",
                "feasible",
                "selected_on",
                *[f"{m.key}{suffix}" for m in report_metrics() for suffix in suffixes],
            ]
        )
        for c in choices:
            cells = []
            for m in report_metrics():
                low, high = spread_interval(m.key, [r.metrics for r in c.runs])
                cells += [c.mean.get(m.key, ""), c.std.get(m.key, ""), low, high]
            writer.writerow(
                [
                    c.model,
                    c.setting,
                    c.method,
                    json.dumps(c.params, default=str),
                    c.n_seeds,
                    c.feasible,
                    c.selected_on,
                    *cells,
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
