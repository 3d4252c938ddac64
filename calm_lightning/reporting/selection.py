"""Step two of a report: the paper's selection rule (Appendix C.3). Runs of one (model, setting,
method) are grouped by their hyper-parameters and averaged over seeds (mean and sample std);
among the settings whose mean accuracy is above `min_accuracy_ratio` (0.8) times the base
model's, the one with the lowest calibration error is chosen: Sem-ECE for open-ended QA,
conf-ECE otherwise (`calibration_key`). When no setting keeps enough accuracy, the lowest among
all is kept and marked infeasible. The rule reads the test split (the paper's) or, with
`split="heldout"`, each run's held-out metrics.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from calm_lightning.errors import CalmLightningError
from calm_lightning.method_traits import UNLISTED_POSITION
from calm_lightning.reporting.collect import Run

# The untouched model's row: every training run records it beside its own (runtime/run_record.py).
BASE_ROW = "base"


def calibration_key(metrics: dict) -> str:
    """The metric the selection rule minimises: Sem-ECE for open-ended QA, else conf-ECE."""
    return "sem_ece" if "sem_ece" in metrics else "conf_ece"


# Where a setting is chosen: on the test split itself (the paper's rule) or on each run's
# held-out metrics (metrics.json's `heldout`), which leave the test split unread.
SELECT_ON = ("test", "heldout")


class MissingHeldout(CalmLightningError):
    """`select(..., split="heldout")` on runs that recorded no held-out metrics."""

    def __init__(self, runs: list[Run]) -> None:
        names = ", ".join(str(r.path) for r in runs[:5]) + (" ..." if len(runs) > 5 else "")
        super().__init__(
            f"--select-on heldout: {len(runs)} finished run(s) have no held-out metrics "
            f"(metrics.json's `heldout`): {names}; rerun them with evaluation.heldout_metrics="
            "true in a setting with held-out data (setting.heldout), or use --select-on test"
        )
        self.runs = runs


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
    selected_on: str = "test"  # the split whose metrics chose it (SELECT_ON)
    criterion: float | None = None  # the mean value it was chosen by, on that split


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def aggregate(rows: list[dict]) -> tuple[dict, dict]:
    """Mean and sample standard deviation (n - 1; 0 for one seed) of every number all `rows`
    hold: ci95, by_source and other nested records are left to the tables."""
    keys = [k for k, v in rows[0].items() if _is_number(v)]
    keys = [k for k in keys if all(_is_number(r.get(k)) for r in rows)]
    mean = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    ddof = 1 if len(rows) > 1 else 0
    std = {k: float(np.std([r[k] for r in rows], ddof=ddof)) for k in keys}
    return mean, std


def heldout_of(run: Run) -> dict | None:
    """A run's held-out metrics (None: it recorded none)."""
    return (run.heldout or {}).get("metrics")


def base_accuracy(runs: list[Run], model: str, setting: str, split: str = "test") -> float | None:
    """The base model's accuracy: a `base` run of the same model and setting, else (test split
    only) the base row a training run evaluated itself."""
    finished = [r for r in runs if r.metrics and r.model == model and r.setting == setting]
    if split == "heldout":
        held = [heldout_of(r) for r in finished if r.method == "base"]
        values = [h["accuracy"] for h in held if h]
        return float(np.mean(values)) if values else None
    direct = [r.metrics["accuracy"] for r in finished if r.method == "base"]
    embedded = [r.base["accuracy"] for r in finished if r.base]
    values = direct or embedded
    return float(np.mean(values)) if values else None


def select(
    runs: list[Run],
    min_accuracy_ratio: float = 0.8,
    metric: str | None = None,
    split: str = "test",
) -> list[Choice]:
    """One choice per (model, setting, method) by the paper's rule (`metric` None: Sem-ECE
    for open-ended QA runs, conf-ECE otherwise), on the test split's metrics or (`split`
    "heldout") on each run's held-out metrics, feasibility against the base runs' held-out
    accuracy (every setting feasible without one). The tables show the test metrics either
    way."""
    finished = [r for r in runs if r.metrics]
    if split == "heldout":
        missing = [r for r in finished if heldout_of(r) is None]
        if missing:
            raise MissingHeldout(missing)
    groups = defaultdict(lambda: defaultdict(list))
    for run in finished:
        key = json.dumps(run.params, sort_keys=True, default=str)
        groups[(run.model, run.setting, run.method)][key].append(run)
    choices = []
    for (model, setting, method), by_params in sorted(groups.items()):
        base_acc = base_accuracy(runs, model, setting, split)
        options = []
        for members in by_params.values():
            mean, std = aggregate([r.metrics for r in members])
            judged = mean if split == "test" else aggregate([heldout_of(r) for r in members])[0]
            feasible = (
                base_acc is None
                or method == "base"
                or (judged["accuracy"] > min_accuracy_ratio * base_acc)
            )
            choice = Choice(
                model, setting, method, members[0].params, mean, std, len(members), members,
                feasible, split,
            )  # fmt: skip
            options.append((choice, judged))
        pool = [o for o in options if o[0].feasible] or options
        key = metric or calibration_key(pool[0][1])
        best, judged = min(pool, key=lambda o: o[1].get(key, np.inf))
        best.criterion = judged.get(key)
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
