"""What a sweep will launch, and what it will cost, before it runs.

    python -m calm_lightning.plan multirun_sweeps/table1_mcqa_ood.sh model=olmo2
    python -m calm_lightning.plan +sweep=calm_ood model=olmo2 --device h200 --json plan.json

A sweep script is run for real with a recording stand-in for Python (`--python`), so the jobs
listed are the `python -m calm_lightning.run` calls the script makes, with its loops and
helpers; each call is expanded into jobs by Hydra's own basic sweeper (the grid of its
`+sweep=` file plus the command line's comma lists), and each job's config is composed like
`calm_lightning.run` composes it. Every job gets GPU-hours and a peak memory on `--device` from
the cost model (cost_model.py: FLOPs from the model's shape and the passes its method makes,
over the device's peak x a stated utilisation; plan_costs.py: the passes per method). A cost
file measured on a GPU (`benchmarks/calm_step.py --json`, `--costs FILE`) replaces the stated
utilisation with the measured one; one whose phases are out of order is refused.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from calm_lightning import cost_model, plan_costs
from calm_lightning.errors import ConfigError
from calm_lightning.models.shapes import Shape, parameter_count

# Head-room on the longest job's estimate for a SLURM time limit: the estimate is an upper
# bound on tokens but assumes a utilisation, and a job killed at its limit loses its work.
SLURM_MARGIN = 0.25
CALM_METHODS = plan_costs.CALM_METHODS  # the bilevel presets (one LightningModule, calm.py)
_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["CALM_PLAN_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@dataclass
class Job:
    """One job of a sweep: its overrides and what its composed config says it will do."""

    overrides: list[str]
    method: str
    model: str
    train_rows: int | None = None
    heldout_rows: int | None = None
    eval_rows: int | None = None
    batch: int = 1
    eval_batch: int = 1
    max_length: int = 1
    train_steps: int = 0
    schedule: str | None = None
    inner_steps: int | None = None
    surrogate_steps: int | None = None
    lower_steps: int = 1
    compare_with_base: bool = False
    heldout_batch: int = 1
    eval_max_length: int = 1
    shape: Shape | None = None  # the architecture the model runs (cost_model.model_shape)
    quantized: bool = True  # nf4 QLoRA (quantization auto on a GPU) or bf16
    lora_r: int = 0
    checkpointing: bool = False
    sampling: tuple[int, int] | None = None  # open QA: (samples, max new tokens) per question
    train_source: str | None = None  # the training data's source class (plan_costs widths)
    reference_shape: Shape | None = None  # post-hoc methods' pre-trained reference model
    reference_quantized: bool = False
    estimate: dict = field(default_factory=dict)


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
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    flag = any(o in ("--multirun", "-m") for o in overrides)
    overrides = [o for o in overrides if o not in ("--multirun", "-m")]
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    task = [o.input_line for o in parsed if not o.get_key_element().startswith("hydra.")]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    hydra_cfg = _compose(fixed, hydra=True).hydra
    sweeper = str(hydra_cfg.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        raise ConfigError(
            f"{' '.join(overrides)}: the sweeper is {sweeper}, whose jobs are chosen while it "
            "runs (e.g. Optuna's n_trials); only the basic sweeper's grids can be listed"
        )
    params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN or flag
    if not multirun and not any(o.is_sweep_override() for o in parsed):
        return [task]
    (jobs,) = BasicSweeper.split_arguments(parser.parse_overrides(params + task), None)
    return jobs


def _compose(overrides: list[str], hydra: bool = False):
    from hydra import compose, initialize_config_module

    import calm_lightning.runtime.resolvers  # noqa: F401  (registers the config resolvers)

    with initialize_config_module("calm_lightning.conf", version_base="1.3"):
        return compose("run", overrides=overrides, return_hydra_config=hydra)


# Rows of hub datasets whose training split is "all the rest" (train_size: null), from their
# dataset cards: PopQA is 14,267 questions in one split.
HUB_ROWS = {"akariasai/PopQA": 14_267}


def split_rows(node) -> int | None:
    """How many rows a data node's split has, from its config (None: only the files know)."""
    if "fit_fraction" in node and "source" in node:  # a fit / test carving of a pool
        pool = split_rows(node.source)
        fit = round(float(node.fit_fraction) * pool) if pool else None
        return None if pool is None else (fit if node.get("part") == "fit" else pool - fit)
    split = node.get("split")
    size = None
    if f"{split}_size" in node:  # alpaca-style: train_size / heldout_size / test_size
        size = node.get(f"{split}_size")
        if size is None and split == "train" and node.get("hub_id") in HUB_ROWS:
            taken = [node.get(k) or 0 for k in ("eval_size", "heldout_size", "test_size")]
            size = HUB_ROWS[node.hub_id] - sum(taken)
    elif "sizes" in node and split in node.sizes:  # mcqa-style blocks
        size = node.sizes[split]
    limit = node.get("limit")
    if size is None:
        return limit
    return min(int(size), int(limit)) if limit else int(size)


def describe(overrides: list[str]) -> Job:
    """Compose one job's config as `calm_lightning.run` would and read what it will do."""
    cfg = _compose(overrides)
    select = OmegaConf.select
    setting, trainer, module = cfg.setting, cfg.trainer, cfg.method.get("module") or {}
    job = Job(
        overrides=overrides,
        method=str(cfg.method.name),
        model=_model_label(select(cfg, "model.name"), select(cfg, "model.shape", default=None)),
        train_rows=split_rows(setting.train) if "train" in setting else None,
        heldout_rows=split_rows(setting.heldout) if "heldout" in setting else None,
        eval_rows=split_rows(setting.test) if "test" in setting else None,
        batch=int(setting.get("batch_size", 1)),
        eval_batch=int(setting.get("eval_batch_size", setting.get("batch_size", 1))),
        max_length=int(setting.get("max_length", 1)),
        compare_with_base=bool(select(cfg, "evaluation.compare_with_base", default=False)),
    )
    _describe_costs(job, cfg)
    epochs = trainer.get("max_epochs")
    if epochs and job.train_rows and job.method not in ("base", "ts"):
        per_epoch = math.ceil(job.train_rows / job.batch)
        limit = trainer.get("limit_train_batches")
        if isinstance(limit, int):
            per_epoch = min(per_epoch, limit)
        elif isinstance(limit, float):
            per_epoch = int(per_epoch * limit)
        job.train_steps = int(epochs) * per_epoch
        if int(trainer.get("max_steps", -1)) > 0:
            job.train_steps = min(job.train_steps, int(trainer.max_steps))
    if job.method in CALM_METHODS:
        job.schedule = str(select(cfg, "method.module.surrogate.schedule", default="per_step"))
        job.inner_steps = int(module.get("inner_steps", 1))
        job.surrogate_steps = int(select(cfg, "method.module.surrogate.steps", default=1))
    if job.method == "iterate":
        job.lower_steps = int(module.get("lower_steps", 1))
    return job


def _describe_costs(job: Job, cfg) -> None:
    """What the cost model needs from a composed config."""
    select, setting = OmegaConf.select, cfg.setting
    model = OmegaConf.to_container(cfg.model, resolve=True)
    job.shape = cost_model.model_shape(model)
    job.quantized = str(model.get("quantization", "auto")) in ("auto", "nf4")  # auto: nf4 on GPU
    job.lora_r = int(select(cfg, "peft.r", default=0) or 0)
    from calm_lightning.models.lora import checkpointing_enabled  # imports torch: not at --help

    job.checkpointing = checkpointing_enabled(
        select(cfg, "peft.gradient_checkpointing", default=False),
        parameter_count(job.shape) if job.shape is not None else 0,
    )
    train_target = str(select(cfg, "setting.train._target_", default="") or "")
    job.train_source = train_target.rsplit(".", 1)[-1] or None
    job.heldout_batch = int(setting.get("heldout_batch_size") or job.batch)
    job.eval_max_length = int(setting.get("eval_max_length", job.max_length))
    test_target = str(select(cfg, "setting.test._target_", default="") or "")
    if test_target.endswith("OpenQASource"):
        openqa = cfg.evaluation.openqa
        job.sampling = (int(openqa.n_samples), int(openqa.max_new_tokens))
    # Only methods whose module takes the reference (daca, dual_align) load the PLM.
    reference = select(cfg, "method.module.reference_model", default=None)
    if reference is not None and str(reference.get("name", "none")) != "none":
        ref = OmegaConf.to_container(reference, resolve=True)
        job.reference_shape = cost_model.model_shape(ref)
        job.reference_quantized = str(ref.get("quantization", "none")) == "nf4"


def _model_label(name, shape) -> str:
    return f"{name} (shape {shape})" if shape else str(name)


def plan(target: str, extra: list[str], device: str | None = None,
         costs: dict | None = None) -> list[Job]:  # fmt: skip
    """Every job `target` launches (in launch order), each with its estimate on `device`
    (default: the local GPU, else the A100 40G); `costs` (a GPU cost file) replaces the
    assumed utilisation with the measured one."""
    device = device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = [describe(job) for call in sweep_calls(target, extra) for job in expand(call)]
    for job in jobs:
        job.estimate = plan_costs.estimate(job, device, measured)
    return jobs


def _hours(seconds) -> str:
    if seconds is None:
        return "?"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def print_plan(jobs: list[Job], device: str, measured: dict | None, costs=None) -> None:
    common = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    spec = cost_model.get_device(device)
    print(f"{len(jobs)} jobs; every job has: {' '.join(sorted(common))}")
    print(
        f"device: {device} ({spec.label}: {spec.peak_tflops:g} TFLOP/s bf16 dense, "
        f"{spec.memory_gib:g} GiB); cost model: calm_lightning/cost_model.py"
    )
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
        print(f"#{index:<3d} {job.method:8s} steps {job.train_steps:6d}  {own}")
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
    if known:
        peak = max(j.estimate["peak_gib"] for j in jobs if "peak_gib" in j.estimate)
        print(
            f"total: {sum(known):.1f} GPU-hours on {device} for {len(known)} of {len(jobs)} "
            f"jobs; largest peak {peak:.1f} GiB"
        )
        print(
            f"SLURM (hydra/launcher=slurm): hydra.launcher.timeout_min="
            f"{slurm_timeout_min(max(known))} covers the longest job with a "
            f"{SLURM_MARGIN:.0%} margin"
        )
    else:
        print("total: no estimate")


def plan_record(jobs: list[Job], device: str, measured: dict | None) -> dict:
    """The plan as json: one record per job, the device and the totals."""
    records = [
        {
            "method": j.method,
            "model": j.model,
            "overrides": j.overrides,
            "steps": j.train_steps,
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
    return {
        "device": device,
        "device_spec": vars(cost_model.get_device(device)),
        "utilisation": measured or {"assumed": cost_model.UTILISATION},
        "jobs": records,
        "total_gpu_hours": sum(hours),
        "max_peak_gib": max(peaks) if peaks else None,
        "slurm_timeout_min": slurm_timeout_min(max(hours)) if hours else None,
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
    print(f"plan: {args.target} {shlex.join(args.overrides)}")
    print_plan(jobs, device, measured, costs)
    if args.json:
        record = plan_record(jobs, device, measured)
        record["command"] = shlex.join(["python -m calm_lightning.plan", args.target,
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
