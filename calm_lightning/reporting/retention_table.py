"""The report's retention tables (the paper's "language ability" check): per (model, setting),
one row per selected method and one column per lm-eval task, mean ± std over seeds of the
runs' retention.json rows. The base row comes from `base` runs where there are some, else from
the base rows the other runs measured (one per seed: they scored the same model)."""

from __future__ import annotations

import csv
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from calm_lightning.method_traits import UNLISTED_POSITION
from calm_lightning.reporting.collect import Run
from calm_lightning.reporting.selection import Choice, method_order, table_positions

METRICS = ("acc", "acc_norm", "conf_ece")


@dataclass
class RetentionRow:
    """One method's retention in one (model, setting): per task, per metric, the seeds'
    values."""

    model: str
    setting: str
    method: str
    values: dict[str, dict[str, list[float]]]  # task -> metric -> one value per seed
    n: dict[str, int]  # task -> documents scored (the first seed's)
    order: tuple[int, str] = (UNLISTED_POSITION, "")  # its place in tables (method_order)

    def mean_std(self, task: str, metric: str) -> tuple[float, float, int] | None:
        values = self.values.get(task, {}).get(metric)
        if not values:
            return None
        return float(np.mean(values)), float(np.std(values)), len(values)


def _add(rows: dict, key: tuple, tasks: dict) -> None:
    model, setting, method = key
    row = rows.setdefault(key, RetentionRow(model, setting, method, defaultdict(dict), {}))
    for task, metrics in tasks.items():
        row.n.setdefault(task, int(metrics.get("n", 0)))
        for metric in METRICS:
            if metric in metrics:
                row.values[task].setdefault(metric, []).append(float(metrics[metric]))


def retention_rows(choices: list[Choice], runs: list[Run]) -> list[RetentionRow]:
    """The selected runs' retention rows, plus one base row per (model, setting)."""
    rows: dict[tuple, RetentionRow] = {}
    base_seeds: dict[tuple, dict[int, dict]] = defaultdict(dict)
    for choice in choices:
        for run in choice.runs:
            if not run.retention:
                continue
            if choice.method != "base" and choice.method in run.retention:
                _add(
                    rows,
                    (choice.model, choice.setting, choice.method),
                    run.retention[choice.method],
                )
            if "base" in run.retention:
                seeds = base_seeds[(choice.model, choice.setting)]
                # A `base` run's own row wins over the base rows other methods measured.
                if choice.method == "base" or run.seed not in seeds:
                    seeds[run.seed] = run.retention["base"]
    for (model, setting), seeds in base_seeds.items():
        for seed in sorted(seeds):
            _add(rows, (model, setting, "base"), seeds[seed])
    positions = table_positions(choices)
    for row in rows.values():
        row.order = method_order(row.method, positions)
    return list(rows.values())


def _cell(row: RetentionRow, task: str, metric: str) -> str:
    stat = row.mean_std(task, metric)
    if stat is None:
        return "-"
    mean, std, n_seeds = stat
    percent = metric != "conf_ece"
    text = f"{100 * mean:.2f}" if percent else f"{mean:.4f}"
    if n_seeds > 1:
        text += f" ± {100 * std:.2f}" if percent else f" ± {std:.4f}"
    return text


def retention_markdown(rows: list[RetentionRow]) -> str:
    """Per (model, setting): an accuracy table (lm-eval's acc, %) and a conf-ECE table."""
    if not rows:
        return ""
    by_table = defaultdict(list)
    for row in rows:
        by_table[(row.model, row.setting)].append(row)
    parts = [
        "## Retention (lm-eval-harness, zero-shot)",
        "",
        "Accuracy (%) as lm-eval computes it (`acc`), and the conf-ECE of the option "
        "distribution it scored (softmax over the choices' log-likelihoods); mean ± std over "
        "seeds.",
        "",
    ]
    for (model, setting), members in sorted(by_table.items()):
        members.sort(key=lambda r: r.order)
        tasks = list(dict.fromkeys(t for r in members for t in r.values))
        for metric, label in (("acc", "acc"), ("conf_ece", "conf-ECE")):
            parts.append(f"### {model} / {setting}: {label}\n")
            parts.append("| method | " + " | ".join(tasks) + " | seeds |")
            parts.append("|---|" + "---|" * (len(tasks) + 1))
            for row in members:
                seeds = max((len(v) for t in row.values.values() for v in t.values()), default=0)
                cells = [_cell(row, task, metric) for task in tasks]
                parts.append(f"| {row.method} | " + " | ".join(cells) + f" | {seeds} |")
            parts.append("")
    return "\n".join(parts)


def write_retention_csv(rows: list[RetentionRow], path: Path) -> Path:
    """retention.csv: one line per (model, setting, method, task), mean and std per metric."""
    with Path(path).open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "model",
                "setting",
                "method",
                "task",
                "n",
                "n_seeds",
                *[f"{m}{s}" for m in METRICS for s in ("", "_std")],
            ]
        )
        for row in sorted(rows, key=lambda r: (r.model, r.setting, r.order)):
            for task in row.values:
                stats = [row.mean_std(task, m) for m in METRICS]
                n_seeds = max((s[2] for s in stats if s), default=0)
                writer.writerow(
                    [
                        row.model,
                        row.setting,
                        row.method,
                        task,
                        row.n.get(task, ""),
                        n_seeds,
                        *[v for s in stats for v in ((s[0], s[1]) if s else ("", ""))],
                    ]
                )
    return Path(path)
