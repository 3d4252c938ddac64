"""What a sweep will launch, and what it will cost, before it runs.

    python -m calm_lightning.plan multirun_sweeps/table1_mcqa_ood.sh model=olmo2
    python -m calm_lightning.plan +sweep=calm_ood model=olmo2 --device h200 --json plan.json

A sweep script is run for real with a recording stand-in for Python (`--python`), so the jobs
listed are the `python -m calm_lightning.run` calls the script makes, with its loops and
helpers; each call is expanded into jobs by Hydra's own basic sweeper (the grid of its
`+sweep=` file plus the command line's comma lists), and each job's config is composed like
`calm_lightning.run` composes it (plan_jobs.py reads what the job will do). Every job gets
GPU-hours and a peak memory on `--device` from the cost model (cost_model.py: FLOPs from the
model's shape and the passes its method makes, over the device's peak x a stated utilisation;
plan_costs.py: the passes per method). A cost file measured on a GPU (`benchmarks/calm_step.py
--json`, `--costs FILE`) replaces the stated utilisation with the measured one; one whose
phases are out of order is refused.

An epoch is what the job's data module yields (`plan_jobs.batches_per_epoch`): under the
default `budget=paper` an epoch of the bilevel methods (CALM, Iterate) is 20 batches, the
paper's Appendix C.2 read as Table 10's costs need it (docs/calm.md, "Reading of the paper");
under `budget=full` every batch. The plan names the budget it priced and prints the total under
each other budget (every job composed again with `budget=` swapped), so the choice is visible
before launch. The base model's evaluation is charged once per base-cache entry
(`plan_jobs.base_cache_key`): later jobs of a sweep read its row. The planner never imports
torch.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

from omegaconf import OmegaConf

from calm_lightning import cost_model, plan_costs
from calm_lightning.errors import ConfigError
from calm_lightning.plan_jobs import CONF_PACKAGE, Job, compose_run, describe, group_options

# Head-room on the longest job's estimate for a SLURM time limit: the estimate is an upper
# bound on tokens but assumes a utilisation, and a job killed at its limit loses its work.
SLURM_MARGIN = 0.25
_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["CALM_PLAN_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def sweep_calls(target: str, extra: list[str]) -> list[list[str]]:
    """The override lists of every `calm_lightning.run` call `target` makes: a sweep script
    (run with a recording Python) or `+sweep=...` (one call)."""
    if not target.endswith(".sh"):
        return [[target, *extra]]
    script = Path(target)
    if not script.is_file():
        raise ConfigError(f"no sweep script at {target}")
    script_args, models = [], []
    for arg in extra:  # the scripts take models as --model (they set model= themselves)
        if arg.startswith("model="):
            models.append(arg.removeprefix("model="))
        else:
            script_args.append(arg)
    if models:
        script_args = ["--model", ",".join(models), *script_args]
    with tempfile.TemporaryDirectory(prefix="calm-plan-") as tmp:
        recorder, log = Path(tmp, "python"), Path(tmp, "calls.jsonl")
        recorder.write_text(_RECORDER.format(python=sys.executable))
        recorder.chmod(0o755)
        done = subprocess.run(
            ["bash", str(script), "--python", str(recorder), "--out", str(Path(tmp, "out")),
             *script_args],
            capture_output=True, text=True, env=dict(os.environ, CALM_PLAN_LOG=str(log)),
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ConfigError(f"{target} {' '.join(script_args)} refused:\n{done.stderr}")
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    runs = [c[2:] for c in calls if c[:2] == ["-m", "calm_lightning.run"]]
    if not runs:
        raise ConfigError(f"{target} makes no `python -m calm_lightning.run` call")
    return runs


def expand(overrides: list[str]) -> list[list[str]]:
    """The jobs one `calm_lightning.run` call launches, by Hydra's basic sweeper: the grid
    in `hydra.sweeper.params` followed by the command line's task overrides."""
    return expand_call(overrides)[0]


def expand_call(overrides: list[str]) -> tuple[list[list[str]], bool]:
    """`expand`'s jobs, and whether they run as a multirun (one sweep folder, whose base cache
    the jobs share) rather than as one run in its own folder."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    flag = any(o in ("--multirun", "-m") for o in overrides)
    overrides = [o for o in overrides if o not in ("--multirun", "-m")]
    parser = OverridesParser.create()
    parsed = _parse(parser, overrides)
    task = [o.input_line for o in parsed if not o.get_key_element().startswith("hydra.")]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    hydra_cfg = compose_run(fixed, hydra=True).hydra
    sweeper = str(hydra_cfg.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        raise ConfigError(
            f"{' '.join(overrides)}: the sweeper is {sweeper}, whose jobs are chosen while it "
            "runs (e.g. Optuna's n_trials); only the basic sweeper's grids can be listed"
        )
    params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN or flag
    if not multirun and not any(o.is_sweep_override() for o in parsed):
        return [task], False
    (jobs,) = BasicSweeper.split_arguments(_parse(parser, params + task), None)
    return jobs, True


def _parse(parser, overrides: list[str]):
    """Hydra's parse of `overrides`; a malformed one as a one-line ConfigError."""
    from hydra.errors import HydraException

    try:
        return parser.parse_overrides(overrides)
    except HydraException as err:
        first = str(err).splitlines()[0]
        raise ConfigError(f"{' '.join(overrides)}: not an override Hydra reads ({first})") from err


def plan(target: str, extra: list[str], device: str | None = None,
         costs: dict | None = None) -> list[Job]:  # fmt: skip
    """Every job `target` launches (in launch order), each with its estimate on `device`
    (default: the local GPU, else the A100 40G); `costs` (a GPU cost file) replaces the
    assumed utilisation with the measured one."""
    device = device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = []
    for index, call in enumerate(sweep_calls(target, extra)):
        expanded, multirun = expand_call(call)
        sweep = _sweep_folder(call, index) if multirun else None
        jobs += [describe(job, sweep) for job in expanded]
    price(jobs, device, measured)
    return jobs


def _sweep_folder(call: list[str], index: int) -> str:
    """The folder a multirun call's jobs share: its `hydra.sweep.dir`, else (the default
    folder is stamped with the launch time) one of its own."""
    for override in reversed(call):
        if override.startswith("hydra.sweep.dir="):
            return override.split("=", 1)[1]
    return f"call {index}"


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
        job.estimate = plan_costs.estimate(job, device, measured)


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
        f"{spec.memory_gib:g} GiB); cost model: calm_lightning/cost_model.py"
    )
    print(budget_line(jobs))
    if measured:
        print(
            f"utilisation measured on {measured['file_device']}: training "
            f"{measured['train']:.0%}" + (f", forward {measured['eval']:.0%}" if "eval" in measured
                                          else "")
        )  # fmt: skip
        for line in plan_costs.calm_ratios(costs or {}):
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
        fits = "" if e["fits"] else f"  DOES NOT FIT {spec.memory_gib:g} GiB"
        print(
            f"      {step}{e['gpu_hours']:.2f} GPU-h (train {_hours(e['train_s'])}, eval "
            f"{_hours(e['eval_s'])}), peak {e['peak_gib']:.1f} GiB{fits}"
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
        paper = plan_costs.paper_comparison(job, e)
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
    }


def slurm_timeout_min(gpu_hours: float) -> int:
    """A SLURM wall-clock limit for a one-GPU job of `gpu_hours`, with the margin."""
    return math.ceil(gpu_hours * 60 * (1 + SLURM_MARGIN))


def add_arguments(parser) -> None:
    parser.add_argument("target", help="a multirun_sweeps/*.sh script or +sweep=NAME")
    parser.add_argument("overrides", nargs="*", help="model=NAME and other key=value overrides")
    parser.add_argument(
        "--device", choices=sorted(cost_model.DEVICES),
        help="the GPU to plan for (default: the local GPU, else a100_40g)",
    )  # fmt: skip
    parser.add_argument(
        "--costs", help="json from benchmarks/calm_step.py --json on a GPU: measured utilisation"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the plan here")


def command(args, parser) -> int:
    """Print the jobs of `args.target` with their estimates."""
    costs = json.loads(Path(args.costs).read_text()) if args.costs else None
    device = args.device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = plan(args.target, args.overrides, device, costs)
    others = other_budgets(jobs, device, measured)
    print(f"plan: {args.target} {shlex.join(args.overrides)}")
    print_plan(jobs, device, measured, costs, others)
    if args.json:
        record = plan_record(jobs, device, measured, others)
        record["command"] = shlex.join(["python", "-m", "calm_lightning.plan", args.target,
                                        *args.overrides, "--device", device])  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.plan`: the same as `python -m calm_lightning plan`."""
    from calm_lightning.cli import command_main

    return command_main("plan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
