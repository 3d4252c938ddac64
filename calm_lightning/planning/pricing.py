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
# The least time a job asks SLURM for: the plan prices no start-up (a 7B model's weights read
# and quantized, the data read and tokenized: minutes), and submitit signals the job
# `signal_delay_s` (5 min, conf/hydra/launcher/slurm.yaml) before its limit to checkpoint.
MIN_TIMEOUT_MIN = 60


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
    """The SLURM launcher's wall-clock limit per job: the one the jobs' call composed
    (`hydra.launcher.timeout_min`, from the command line or the launcher's config, where they
    run under a launcher with a limit), else a `hydra.launcher.timeout_min=` every job passes,
    else conf/hydra/launcher/slurm.yaml's (what `hydra/launcher=slurm` would give them)."""
    composed = {j.launcher_limit_min for j in jobs}
    if len(composed) == 1 and None not in composed:
        return int(composed.pop())
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


def job_launcher_limits(job: Job, limit_min: int | None = None) -> dict:
    """What one priced job needs from the SLURM launcher (empty without an estimate):
    `needed_min`, its time with the margin; `limit_min`, the launcher's limit (`limit_min`, else
    `slurm_limit_min`); `timeout_min`, the shorter of the two but at least MIN_TIMEOUT_MIN (a
    short job asks for less, which SLURM schedules sooner); `max_num_timeout`,
    ceil(needed / timeout_min), at least 1: a job needs ceil(needed / limit) - 1 requeues, and
    the one more is room for the work lost at each cut (a requeued job resumes from its last
    checkpoint)."""
    hours = job.estimate.get("gpu_hours")
    if hours is None:
        return {}
    limit = int(limit_min or slurm_limit_min([job]))
    needed = max(slurm_timeout_min(hours), 1)
    timeout = min(max(needed, MIN_TIMEOUT_MIN), limit)
    return {
        "needed_min": needed,
        "limit_min": limit,
        "timeout_min": timeout,
        "max_num_timeout": math.ceil(needed / timeout),
    }


def launcher_limits(jobs: list[Job]) -> dict:
    """What the jobs of one `calm_lightning.run` call need from the launcher, which gives all
    of them the same limit and requeues: the most any of them needs (`job_launcher_limits`);
    empty when none has an estimate."""
    limit = slurm_limit_min(jobs)
    each = [job_launcher_limits(job, limit) for job in jobs]
    each = [e for e in each if e]
    return max(each, key=lambda e: e["needed_min"]) if each else {}


def launcher_overrides(jobs: list[Job]) -> list[str]:
    """`launcher_limits` as the Hydra overrides a sweep script adds to the call's command
    (multirun_sweeps/lib.sh, under hydra/launcher=slurm)."""
    limits = launcher_limits(jobs)
    if not limits:
        return []
    return [
        f"hydra.launcher.timeout_min={limits['timeout_min']}",
        f"hydra.launcher.max_num_timeout={limits['max_num_timeout']}",
    ]


def calls_of(jobs: list[Job]) -> dict[int, list[Job]]:
    """The jobs grouped by the `calm_lightning.run` call that launches them, in order."""
    calls: dict[int, list[Job]] = {}
    for job in jobs:
        calls.setdefault(job.call, []).append(job)
    return calls
