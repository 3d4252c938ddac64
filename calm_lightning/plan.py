"""What a sweep will launch, and what it will cost, before it runs. A sweep script is really
run by bash, with only its python calls recorded instead of run: its other commands (mkdir,
its helpers, anything it calls) run as they would, so plan only a script you would run.

    python -m calm_lightning.plan multirun_sweeps/table1_mcqa_ood.sh model=olmo2
    python -m calm_lightning.plan +sweep=calm_ood model=olmo2 --device h200 --json plan.json

A sweep script is run for real with a recording stand-in for Python (`--python`), so the jobs
listed are the `python -m calm_lightning.run` calls the script makes, with its loops and
helpers; each call is expanded into jobs by Hydra's own basic sweeper (the grid of its
`+sweep=` file plus the command line's comma lists), and each job's config is composed like
`calm_lightning.run` composes it (planning/jobs.py reads what the job will do). Every job gets
GPU-hours and a peak memory on `--device` from the cost model (planning/cost_model.py: FLOPs
from the model's shape and the passes its method makes, over the device's peak x a stated
utilisation; planning/passes.py: the passes per method). A cost file measured on a GPU
(`benchmarks/calm_step.py --json`, `--costs FILE`) replaces the stated utilisation with the
measured one; one whose phases are out of order is refused.

An epoch is what the job's data module yields (`planning.jobs.batches_per_epoch`): under the
default `budget=paper` an epoch of the bilevel methods (CALM, Iterate) is 20 batches, the
paper's Appendix C.2 read as Table 10's costs need it (docs/calm.md, "Reading of the paper");
under `budget=full` every batch. The plan names the budget it priced and prints the total under
each other budget (every job composed again with `budget=` swapped), so the choice is visible
before launch. The base model's evaluation is charged once per base-cache entry
(`planning.jobs.base_cache_key`): later jobs of a sweep read its row. A job fits when its peak
is at most the memory CUDA reports for the device (`cost_model.usable_gib`). The plan prints
the quantization it assumed per model (`models.model_node.planned_quantization`), warns on
unpinned Hub revisions, and gives each run call the SLURM limit and requeues its own jobs need
(`--launcher-overrides` prints only those: what multirun_sweeps/lib.sh passes each grid). The
planner never imports torch.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from calm_lightning.planning import cost_model
from calm_lightning.planning.jobs import Job  # noqa: F401  (the planner's job record)
from calm_lightning.planning.output import plan_record, print_plan
from calm_lightning.planning.pricing import (  # noqa: F401  (part of the command's interface)
    budget_line,
    job_launcher_limits,
    launcher_limits,
    launcher_overrides,
    other_budgets,
    slurm_suggestion,
)
from calm_lightning.planning.sweep import plan


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
    parser.add_argument(
        "--launcher-overrides", action="store_true",
        help="print only the hydra.launcher.timeout_min / max_num_timeout overrides the jobs "
        "need under hydra/launcher=slurm (one line; what multirun_sweeps/lib.sh passes a grid)",
    )  # fmt: skip


def command(args, parser) -> int:
    """Print the jobs of `args.target` with their estimates."""
    costs = json.loads(Path(args.costs).read_text()) if args.costs else None
    device = args.device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = plan(args.target, args.overrides, device, costs)
    if args.launcher_overrides:
        print(" ".join(launcher_overrides(jobs)))
        return 0
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
    from calm_lightning.arguments import command_main

    return command_main("calm_lightning.plan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
