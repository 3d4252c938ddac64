"""A priced sweep as text (`print_plan`) and as the `--json` record (`plan_record`)."""

from __future__ import annotations

from calm_lightning.planning import cost_model, passes
from calm_lightning.planning.jobs import Job
from calm_lightning.planning.pricing import (
    SLURM_MARGIN,
    base_cache_line,
    budget_line,
    calls_of,
    job_launcher_limits,
    launcher_limits,
    slurm_suggestion,
)


def _hours(seconds) -> str:
    if seconds is None:
        return "?"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def print_plan(jobs: list[Job], device: str, measured: dict | None, costs=None,
               others: dict[str, float] | None = None) -> None:  # fmt: skip
    """The plan as text; `others`: the sweep's total under each other budget."""
    common = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    spec = cost_model.get_device(device)
    print(f"{len(jobs)} jobs; every job has: {' '.join(sorted(common))}")
    print(
        f"device: {device} ({spec.label}: {spec.peak_tflops:g} TFLOP/s bf16 dense, "
        f"{spec.memory_gb:g} GB sold, {spec.usable_gib:g} GiB usable as CUDA reports it); "
        "cost model: calm_lightning/planning/cost_model.py"
    )
    print(budget_line(jobs))
    for line in assumption_lines(jobs):
        print(line)
    if measured:
        print(
            f"utilisation measured on {measured['file_device']}: training "
            f"{measured['train']:.0%}" + (f", forward {measured['eval']:.0%}" if "eval" in measured
                                          else "")
        )  # fmt: skip
        for line in passes.calm_ratios(costs or {}):
            print(f"  {line}")
    print()
    for index, job in enumerate(jobs):
        own = " ".join(o for o in job.overrides if o not in common)
        epochs = f" ({job.epochs} x {job.epoch_batches})" if job.train_steps else ""
        print(f"#{index:<3d} {job.method:8s} steps {job.train_steps:6d}{epochs}  {own}")
        e = job.estimate
        if "gpu_hours" not in e:
            print(f"      no estimate: {e['basis']}")
            continue
        step = f"{e['step_s']:.2f} s/step, " if job.train_steps else ""
        fits = "" if e["fits"] else f"  DOES NOT FIT {spec.usable_gib:g} GiB"
        print(
            f"      {step}{e['gpu_hours']:.2f} GPU-h (train {_hours(e['train_s'])}, eval "
            f"{_hours(e['eval_s'])}), {'nf4' if job.quantized else 'bf16'}, peak "
            f"{e['peak_gib']:.1f} GiB{fits}"
        )
        if job.base_read_from is not None:
            print(f"      base model: read from #{job.base_read_from}'s base cache, not scored")
        if "checkpointed_peak_gib" in e:
            print(
                f"      with peft.gradient_checkpointing=true: peak "
                f"{e['checkpointed_peak_gib']:.1f} GiB (one more forward per pass)"
            )
        if "uncheckpointed" in e:
            print(
                f"      fits without checkpointing (peft.gradient_checkpointing=false): "
                f"{e['uncheckpointed']['step_s']:.2f} s/step, peak "
                f"{e['uncheckpointed']['peak_gib']:.1f} GiB"
            )
        paper = passes.paper_comparison(job, e)
        if paper:
            print(f"      {paper}")
    known = [j.estimate["gpu_hours"] for j in jobs if "gpu_hours" in j.estimate]
    print()
    if not known:
        print("total: no estimate")
        return
    peak = max(j.estimate["peak_gib"] for j in jobs if "peak_gib" in j.estimate)
    print(
        f"total: {sum(known):.1f} GPU-hours on {device} for {len(known)} of {len(jobs)} "
        f"jobs; largest peak {peak:.1f} GiB"
    )
    for name, hours in (others or {}).items():
        print(f"  with budget={name}: {hours:.1f} GPU-hours (the same jobs, budget swapped)")
    print(base_cache_line(jobs))
    slurm = slurm_suggestion(max(known), jobs)
    print(
        f"SLURM (hydra/launcher=slurm): hydra.launcher.timeout_min={slurm['timeout_min']} "
        f"covers the longest job with a {SLURM_MARGIN:.0%} margin; at the launcher's "
        f"{slurm['limit_min']}-minute limit instead, hydra.launcher.max_num_timeout="
        f"{slurm['max_num_timeout']} (ceil({slurm['timeout_min']} / {slurm['limit_min']}) "
        "requeues, each resuming from the last checkpoint)"
    )
    for line in call_limit_lines(jobs):
        print(line)


def assumption_lines(jobs: list[Job]) -> list[str]:
    """What the plan assumes each model loads as, and why (one line per model and assumption;
    each job's line says nf4 or bf16), and a WARN line per unpinned Hub revision."""
    seen: dict[str, str] = {}
    for job in jobs:
        seen.setdefault(f"{job.model} {'nf4' if job.quantized else 'bf16'}",
                        job.quantization_reason)  # fmt: skip
    lines = [f"quantization assumed: {what}: {why}" for what, why in seen.items()]
    return lines + [f"WARN {note}" for note in sorted({n for j in jobs for n in j.unpinned})]


def call_limit_lines(jobs: list[Job]) -> list[str]:
    """Each run call's SLURM limit and requeues (`launcher_limits`), where there are several."""
    calls = calls_of(jobs)
    if len(calls) < 2:
        return []
    lines = ["SLURM per run call (the sweep scripts pass these under hydra/launcher=slurm):"]
    for index, members in calls.items():
        limits = launcher_limits(members)
        if limits:
            lines.append(
                f"  call {index} (#{jobs.index(members[0])}-#{jobs.index(members[-1])}, "
                f"{_call_label(members)}): hydra.launcher.timeout_min={limits['timeout_min']} "
                f"hydra.launcher.max_num_timeout={limits['max_num_timeout']} (longest job "
                f"{limits['needed_min']} min with the margin)"
            )
    return lines


def _call_label(members: list[Job]) -> str:
    """The overrides every job of one call shares that name it (its grid and model)."""
    common = set.intersection(*(set(j.overrides) for j in members))
    named = [o for o in members[0].overrides if o in common and o.startswith(("+sweep=", "model="))]
    return " ".join(named) or members[0].method


def plan_record(jobs: list[Job], device: str, measured: dict | None,
                others: dict[str, float] | None = None) -> dict:  # fmt: skip
    """The plan as json: one record per job, the device, the budget and the totals."""
    records = [
        {
            "method": j.method,
            "model": j.model,
            "overrides": j.overrides,
            "steps": j.train_steps,
            "epochs": j.epochs,
            "epoch_batches": j.epoch_batches,
            "base_read_from": j.base_read_from,
            **{
                k: j.estimate.get(k)
                for k in (
                    "step_s",
                    "train_s",
                    "eval_s",
                    "gpu_hours",
                    "peak_gib",
                    "fits",
                    "utilisation",
                    "basis",
                )
            },
            "quantization": "nf4" if j.quantized else "bf16",
            "quantization_reason": j.quantization_reason,
            "revision_warnings": j.unpinned,
            "call": j.call,
            "slurm": job_launcher_limits(j),
        }  # fmt: skip
        for j in jobs
    ]
    hours = [r["gpu_hours"] for r in records if r["gpu_hours"] is not None]
    peaks = [r["peak_gib"] for r in records if r["peak_gib"] is not None]
    slurm = slurm_suggestion(max(hours), jobs) if hours else {}
    return {
        "device": device,
        "device_spec": vars(cost_model.get_device(device)),
        "utilisation": measured or {"assumed": cost_model.UTILISATION},
        "budget": sorted({j.budget for j in jobs}, key=str),
        "budget_line": budget_line(jobs),
        "jobs": records,
        "total_gpu_hours": sum(hours),
        "other_budgets_gpu_hours": others or {},
        "base_model_scored_by": sum(
            1 for j in jobs if j.train_steps and j.compare_with_base and j.base_read_from is None
        ),
        "max_peak_gib": max(peaks) if peaks else None,
        "slurm_timeout_min": slurm.get("timeout_min"),
        "slurm_limit_min": slurm.get("limit_min"),
        "max_num_timeout": slurm.get("max_num_timeout"),
        "launcher_calls": {
            str(index): launcher_limits(members) for index, members in calls_of(jobs).items()
        },
    }
