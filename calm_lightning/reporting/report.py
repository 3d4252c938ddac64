"""Collect finished runs (single runs or multirun sweeps), apply the paper's selection rule and
write paper-style tables, the chosen hyper-parameters and a reliability-diagram grid.

Selection (paper, Appendix C.3): per model, setting and method, the hyper-parameter setting
with the lowest conf-ECE among those whose accuracy is above `min_accuracy_ratio` (0.8) times
the base model's accuracy; seeds of one setting are averaged first (mean ± std).
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

COLUMNS = (
    ("sem_ece", "Sem-ECE", min),
    ("conf_ece", "conf-ECE", min),
    ("cw_ece", "cw-ECE", min),
    ("mce", "MCE", min),
    ("ace", "ACE", min),
    ("brier", "Brier", min),
    ("accuracy", "Acc.", max),
)
RESULT_METRICS = ("accuracy", "sem_ece", "conf_ece", "cw_ece", "mce", "ace", "brier", "nll")


def calibration_key(metrics: dict) -> str:
    """The metric the selection rule minimises: Sem-ECE for open-ended QA, else conf-ECE."""
    return "sem_ece" if "sem_ece" in metrics else "conf_ece"


SELECTED_METRICS = ("accuracy", "sem_ece", "conf_ece", "cw_ece", "mce", "ace", "brier")
IGNORED_KEYS = ("paths.", "hydra.", "trainer.default_root_dir", "logger.", "callbacks.", "seed")


@dataclass
class Run:
    path: Path
    model: str
    method: str
    setting: str
    seed: int
    config: dict
    metrics: dict | None = None
    base: dict | None = None
    error: str | None = None
    params: dict = field(default_factory=dict)


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node if not isinstance(node, list) else tuple(node)}


def collect_runs(roots: list[str | Path]) -> list[Run]:
    """Every run directory below `roots` (a dir holding config_resolved.yaml), finished or not."""
    runs = []
    for root in roots:
        for config_path in sorted(Path(root).rglob("config_resolved.yaml")):
            run_dir = config_path.parent
            config = OmegaConf.to_container(OmegaConf.load(config_path))
            flat = _flatten(config)
            run = Run(
                run_dir,
                flat.get("model.name", "?"),
                flat.get("method.name", "?"),
                flat.get("setting.name", "?"),
                int(flat.get("seed", 0)),
                flat,
            )
            metrics_file, failed_file = run_dir / "metrics.json", run_dir / "failed.json"
            if metrics_file.is_file():
                payload = json.loads(metrics_file.read_text())
                run.metrics = payload["metrics"]
                run.base = (payload.get("comparison") or {}).get("base")
            elif failed_file.is_file():
                run.error = json.loads(failed_file.read_text()).get("error", "failed")
            else:
                run.error = "no metrics.json (interrupted or still running)"
            runs.append(run)
    _mark_swept_parameters(runs)
    return runs


def _mark_swept_parameters(runs: list[Run]) -> None:
    """A run's hyper-parameters = the config keys that differ within its (model, setting,
    method) group, seeds and paths excluded."""
    groups = defaultdict(list)
    for run in runs:
        groups[(run.model, run.setting, run.method)].append(run)
    for members in groups.values():
        keys = set().union(*(m.config for m in members))
        varying = sorted(
            k
            for k in keys
            if not k.startswith(IGNORED_KEYS)
            and len({repr(m.config.get(k)) for m in members}) > 1
            and not _follows_seed(k, members)
        )
        for member in members:
            member.params = {k: member.config.get(k) for k in varying}


def _follows_seed(key: str, members: list[Run]) -> bool:
    """Keys interpolated from `${seed}` (a method's or a data split's seed) vary with the seed
    and are not hyper-parameters: runs that differ only there are seeds of one setting."""
    return all(m.config.get(key) == m.seed for m in members)


@dataclass
class Choice:
    model: str
    setting: str
    method: str
    params: dict
    mean: dict
    std: dict
    n_seeds: int
    runs: list[Run]
    feasible: bool


def _aggregate(runs: list[Run]) -> tuple[dict, dict]:
    keys = runs[0].metrics.keys()
    mean = {k: float(np.mean([r.metrics[k] for r in runs])) for k in keys}
    std = {k: float(np.std([r.metrics[k] for r in runs])) for k in keys}
    return mean, std


def base_accuracy(runs: list[Run], model: str, setting: str) -> float | None:
    """The base model's accuracy: a `base` run of the same model and setting, else the base
    row a training run evaluated itself."""
    finished = [r for r in runs if r.metrics and r.model == model and r.setting == setting]
    direct = [r.metrics["accuracy"] for r in finished if r.method == "base"]
    embedded = [r.base["accuracy"] for r in finished if r.base]
    values = direct or embedded
    return float(np.mean(values)) if values else None


def select(
    runs: list[Run], min_accuracy_ratio: float = 0.8, metric: str | None = None
) -> list[Choice]:
    """One choice per (model, setting, method) by the paper's rule (`metric` None: Sem-ECE
    for open-ended QA runs, conf-ECE otherwise)."""
    finished = [r for r in runs if r.metrics]
    groups = defaultdict(lambda: defaultdict(list))
    for run in finished:
        key = json.dumps(run.params, sort_keys=True, default=str)
        groups[(run.model, run.setting, run.method)][key].append(run)
    choices = []
    for (model, setting, method), by_params in sorted(groups.items()):
        base_acc = base_accuracy(runs, model, setting)
        options = []
        for members in by_params.values():
            mean, std = _aggregate(members)
            feasible = (
                base_acc is None
                or method == "base"
                or (mean["accuracy"] > min_accuracy_ratio * base_acc)
            )
            options.append(
                Choice(
                    model,
                    setting,
                    method,
                    members[0].params,
                    mean,
                    std,
                    len(members),
                    members,
                    feasible,
                )
            )
        pool = [o for o in options if o.feasible] or options
        key = metric or calibration_key(pool[0].mean)
        best = min(pool, key=lambda o: o.mean[key])
        choices.append(best)
    return choices


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
    parts = []
    for (model, setting), rows in sorted(by_table.items()):
        # Only the metrics some row reports (MCQA and open-ended QA report different ones).
        columns = [c for c in COLUMNS if any(c[0] in row.mean for row in rows)]
        best = {
            key: pick(
                rows, key=lambda c, k=key, p=pick: c.mean.get(k, np.inf if p is min else -np.inf)
            )
            for key, _, pick in columns
        }
        parts.append(f"### {model} / {setting}\n")
        parts.append("| method | " + " | ".join(label for _, label, _ in columns) + " | seeds |")
        parts.append("|---|" + "---|" * (len(columns) + 1))
        for row in sorted(rows, key=lambda c: _method_order(c.method)):
            cells = [_cell(row, key, row is best[key]) for key, _, _ in columns]
            parts.append(f"| {row.method} | " + " | ".join(cells) + f" | {row.n_seeds} |")
        parts.append("")
    if any(not c.feasible for c in choices):
        parts.append(
            "† no setting of this method kept accuracy above the threshold; the lowest "
            "conf-ECE (Sem-ECE for open-ended QA) among all its runs is shown.\n"
        )
    return "\n".join(parts)


_ORDER = [
    "base",
    "ts",
    "ls",
    "reg",
    "iterate",
    "cft",
    "calm",
    "elicitation",
    "cape",
    "ic",
    "daca",
    "dual_align",
]


def _method_order(method: str) -> int:
    return _ORDER.index(method) if method in _ORDER else len(_ORDER)


def write_report(runs: list[Run], out: str | Path, min_accuracy_ratio: float = 0.8) -> dict:
    """Write report.md, results.csv, selected.csv and reliability_grid.png under `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    choices = select(runs, min_accuracy_ratio)
    failed = [r for r in runs if r.error]
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
        "| model | setting | method | hyper-parameters | selected on | value | Acc. |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in choices:
        params = ", ".join(f"{k.split('.')[-1]}={v}" for k, v in c.params.items()) or "-"
        key = calibration_key(c.mean)
        lines.append(
            f"| {c.model} | {c.setting} | {c.method} | {params} | {key} | "
            f"{c.mean[key]:.4f} | {100 * c.mean['accuracy']:.2f}% |"
        )
    if failed:
        lines += ["", "## Failed or unfinished runs", ""]
        lines += [f"- `{r.path}`: {r.error}" for r in failed]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    with (out / "results.csv").open("w", newline="") as handle:
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
                *RESULT_METRICS,
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
                    *[m.get(k, "") for k in RESULT_METRICS],
                ]
            )
    with (out / "selected.csv").open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(
            [
                "model",
                "setting",
                "method",
                "params",
                "n_seeds",
                "feasible",
                *[f"{k}{suffix}" for k in SELECTED_METRICS for suffix in ("", "_std")],
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
                        for k in SELECTED_METRICS
                        for value in (c.mean.get(k, ""), c.std.get(k, ""))
                    ],
                ]
            )
    grid = reliability_grid(choices, out / "reliability_grid.png")
    return {"choices": choices, "failed": failed, "grid": grid}


def reliability_grid(choices: list[Choice], path: Path) -> Path | None:
    """One row per (model, setting), one panel per selected method (its first seed's diagram)."""
    import matplotlib.image as mpimg
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = defaultdict(list)
    for c in choices:
        image = c.runs[0].path / "reliability.png"
        if image.is_file():
            rows[(c.model, c.setting)].append((c.method, image))
    if not rows:
        return None
    n_cols = max(len(v) for v in rows.values())
    fig = Figure(figsize=(5.5 * n_cols, 2.9 * len(rows)), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    for i, (key, panels) in enumerate(sorted(rows.items())):
        panels.sort(key=lambda p: _method_order(p[0]))
        for j in range(n_cols):
            ax = fig.add_subplot(len(rows), n_cols, i * n_cols + j + 1)
            ax.axis("off")
            if j < len(panels):
                ax.imshow(mpimg.imread(panels[j][1]))
                ax.set_title(f"{key[0]} / {key[1]}: {panels[j][0]}", fontsize=9)
    fig.savefig(path)
    return path
