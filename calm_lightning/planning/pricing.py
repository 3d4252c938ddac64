"""A sweep's price: each job's estimate (passes.py on cost_model.py), the base model charged
once per base-cache entry, the total under the other budgets, and the SLURM limits the
longest job needs. Nothing here imports torch."""

from __future__ import annotations

import json
import math
from importlib import resources

from omegaconf import OmegaConf

from calm_lightning.planning import passes
from calm_lightning.planning.jobs import CONF_PACKAGE, Job, describe, group_options

# Head-room on the longest job's estimate for a SLURM time limit: the estimate is an upper
# bound on tokens but assumes a utilisation, and a job killed at its limit loses its work.
SLURM_MARGIN = 0.25


def price(jobs: list[Job], device: str, measured: dict | None) -> None:
    """Each job's estimate; a job whose base-cache entry an earlier job wrote reads that row
    (`base_read_from`) and is charged no base-model evaluation."""
    first: dict[str, int] = {}
    for index, job in enumerate(jobs):
        job.base_read_from = None
        if job.base_key is not None and job.train_steps:
            job.base_read_from = first.setdefault(job.base_key, index)
            if job.base_read_from == index:
                job.base_read_from = None
        job.estimate = passes.estimate(job, device, measured)


def other_budgets(jobs: list[Job], device: str, measured: dict | None) -> dict[str, float]:
    """The sweep's total GPU-hours under each other option of conf/budget/: every job composed
    again with `budget=` swapped (the rest of its overrides as they are)."""
    used = {j.budget for j in jobs}
    if None in used:  # a config tree without the budget group
        return {}
    totals = {}
    for name in group_options("budget"):
        if used == {name}:
            continue
        swapped = []
        for job in jobs:
            overrides = [o for o in job.overrides if not o.startswith("budget=")]
            swapped.append(describe([*overrides, f"budget={name}"], _sweep_of(job)))
        price(swapped, device, measured)
        totals[name] = sum(j.estimate.get("gpu_hours", 0.0) for j in swapped)
    return totals


def _sweep_of(job: Job) -> str | None:
    """The sweep folder a described job was given (kept in its base-cache key)."""
    return json.loads(job.base_key)["folder"] if job.base_key else None


def budget_line(jobs: list[Job]) -> str:
    """Which budget the plan priced, and what it means for the epochs."""
    budgets = sorted({(j.budget, j.bilevel_epoch_batches) for j in jobs}, key=str)
    if budgets == [(None, None)]:
        return "budget: none (no conf/budget group): every epoch is every batch"
    parts = []
    for name, size in budgets:
        if size:
            parts.append(
                f"budget: {name} (bilevel epochs of {size} batches: an epoch of CALM and Iterate "
                f"is {size} training batches, as the paper's Appendix C.2 and Table 10 read; "
                "the other methods run every batch)"
            )
        else:
            parts.append(f"budget: {name} (every method's epoch is every batch)")
    return "; ".join(parts)


def base_cache_line(jobs: list[Job]) -> str:
    """How often the plan charges the base model's evaluation (`compare_with_base`)."""
    training = [j for j in jobs if j.train_steps and j.compare_with_base]
    if not training:
        return "base model: no training job compares with it"
    scored = [j for j in training if j.base_read_from is None]
    cached = len({j.base_key for j in training if j.base_key is not None})
    return (
        f"base model: scored by {len(scored)} of {len(training)} training jobs "
        f"({cached} base-cache entries; evaluation.base_cache: the other jobs of a sweep with "
        "the same model, test data and scoring read the first one's row)"
    )


def slurm_limit_min(jobs: list[Job]) -> int:
    """The SLURM launcher's wall-clock limit per job: a `hydra.launcher.timeout_min=` every
    job passes, else conf/hydra/launcher/slurm.yaml's."""
    given = {o.split("=", 1)[1] for j in jobs for o in j.overrides
             if o.startswith("hydra.launcher.timeout_min=")}  # fmt: skip
    if len(given) == 1 and all(
        any(o.startswith("hydra.launcher.timeout_min=") for o in j.overrides) for j in jobs
    ):
        return int(given.pop())
    launcher = resources.files(CONF_PACKAGE).joinpath("hydra", "launcher", "slurm.yaml")
    return int(OmegaConf.create(launcher.read_text()).timeout_min)


def slurm_suggestion(longest_gpu_hours: float, jobs: list[Job]) -> dict:
    """Two ways to run the longest job under SLURM, from the same estimate with the margin: a
    limit that covers it (`timeout_min`), or the launcher's limit with as many requeues as it
    takes limits (`max_num_timeout`: ceil(that time / limit); each requeue resumes from the
    last checkpoint, and counting whole limits leaves room for the work lost at each cut)."""
    needed = slurm_timeout_min(longest_gpu_hours)
    limit = slurm_limit_min(jobs)
    return {"timeout_min": needed, "limit_min": limit, "max_num_timeout": math.ceil(needed / limit)}


def slurm_timeout_min(gpu_hours: float) -> int:
    """A SLURM wall-clock limit for a one-GPU job of `gpu_hours`, with the margin."""
    return math.ceil(gpu_hours * 60 * (1 + SLURM_MARGIN))
