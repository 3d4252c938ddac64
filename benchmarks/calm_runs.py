"""Summarise CALM run directories: test metrics and the logged inner-loop trajectories.

For each `<run dir>` (made by `python -m calm_lightning.run method=calm ... logger=csv`) prints
accuracy, conf-ECE, NLL and mean confidence from metrics.json, and from csv/metrics.csv the
held-out entropy, lambda, q, q / g, g and the head's mean d at the first and the last outer
step, and the mean q. Run dirs named `<label>_s<seed>` are also grouped by label (mean +- std
over seeds).

    python benchmarks/calm_runs.py outputs/quality/*_s*
"""

from __future__ import annotations

import argparse
import csv
import re
import statistics
from pathlib import Path

from calm_lightning.runtime.run_record import read_run

TRAJECTORY = ["entropy", "lambda", "q", "q_rel", "g", "d_mean"]


def summarise(run_dir: Path) -> dict:
    metrics = read_run(run_dir).metrics
    with open(run_dir / "csv" / "metrics.csv") as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("calm/outer_step")]
    rows.sort(key=lambda r: float(r["calm/outer_step"]))
    out = {
        "run": run_dir.name,
        "steps": len(rows),
        "accuracy": metrics["accuracy"],
        "conf_ece": metrics["conf_ece"],
        "nll": metrics["nll"],
        "mean_confidence": metrics["mean_confidence"],
    }
    for key in TRAJECTORY:
        values = [float(r[f"calm/{key}"]) for r in rows if r.get(f"calm/{key}")]
        out[f"{key}_first"], out[f"{key}_last"] = (values[0], values[-1]) if values else (0, 0)
    out["q_mean"] = statistics.fmean(float(r["calm/q"]) for r in rows)
    return out


COLUMNS = [
    ("accuracy", "{:.3f}"),
    ("conf_ece", "{:.3f}"),
    ("nll", "{:.3f}"),
    ("mean_confidence", "{:.3f}"),
    ("entropy_first", "{:.2f}"),
    ("entropy_last", "{:.2f}"),
    ("lambda_first", "{:.2f}"),
    ("lambda_last", "{:.2f}"),
    ("q_mean", "{:.4f}"),
    ("q_rel_first", "{:.2%}"),
    ("d_mean_last", "{:.4f}"),
    ("g_first", "{:.2f}"),
    ("g_last", "{:.2f}"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    args = parser.parse_args()
    rows = [summarise(p) for p in args.runs]
    header = "| run | steps | " + " | ".join(c for c, _ in COLUMNS) + " |"
    print(header)
    print("|" + "---|" * (len(COLUMNS) + 2))
    for row in rows:
        cells = [fmt.format(row[c]) for c, fmt in COLUMNS]
        print(f"| {row['run']} | {row['steps']} | " + " | ".join(cells) + " |")
    groups: dict[str, list[dict]] = {}
    for row in rows:
        groups.setdefault(re.sub(r"_s\d+$", "", row["run"]), []).append(row)
    print()
    for label, members in groups.items():
        if len(members) < 2:
            continue
        cells = []
        for column, fmt in COLUMNS:
            values = [m[column] for m in members]
            cells.append(f"{fmt.format(statistics.fmean(values))} ± "
                         f"{fmt.format(statistics.stdev(values))}")  # fmt: skip
        print(f"| {label} (n={len(members)}) | | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
