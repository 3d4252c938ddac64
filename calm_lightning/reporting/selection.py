"""Step two of a report: the paper's selection rule (Appendix C.3). Runs of one (model, setting,
method) are grouped by their hyper-parameters and averaged over seeds (mean ± std); among the
settings whose mean accuracy is above `min_accuracy_ratio` (0.8) times the base model's, the
one with the lowest calibration error is chosen: Sem-ECE for open-ended QA, conf-ECE otherwise
(`calibration_key`). When no setting keeps enough accuracy, the lowest among all is kept and
marked infeasible.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from calm_lightning.method_traits import UNLISTED_POSITION
from calm_lightning.reporting.collect import Run

# The untouched model's row: every training run records it beside its own (runtime/run_record.py).
BASE_ROW = "base"


def calibration_key(metrics: dict) -> str:
    """The metric the selection rule minimises: Sem-ECE for open-ended QA, else conf-ECE."""
    return "sem_ece" if "sem_ece" in metrics else "conf_ece"


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


def table_positions(choices: list[Choice]) -> dict[str, int]:
    """Where each method's row goes, from what its runs' configs declare
    (`method.traits.table_position`); the untouched model's row first."""
    positions = {c.method: c.runs[0].table_position for c in choices if c.runs}
    positions.setdefault(BASE_ROW, -1)
    return positions


def method_order(method: str, positions: dict[str, int]) -> tuple[int, str]:
    """The sort key of a method's row: its declared position (runs saved before traits
    existed: last), then its name."""
    return positions.get(method, UNLISTED_POSITION), method
