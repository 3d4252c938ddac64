"""What a sweep will launch, and what it will cost, before it runs.

    python -m calm_lightning.plan multirun_sweeps/table1_mcqa_ood.sh model=olmo2
    python -m calm_lightning.plan +sweep=calm_ood model=olmo2 --costs costs.json

A sweep script is run for real with a recording stand-in for Python (`--python`), so the jobs
listed are the `python -m calm_lightning.run` calls the script makes, with its loops and
helpers; each call is expanded into jobs by Hydra's own basic sweeper (the grid of its
`+sweep=` file plus the command line's comma lists), and each job's config is composed like
`calm_lightning.run` composes it. With `--costs FILE` (written by `benchmarks/calm_step.py
--json`) every job gets a wall-time and peak-memory estimate, each number labelled by where
it comes from: measured, scaled from a measurement, composed from measurements, or the
paper's (CALM paper, Table 10: a CALM epoch costs ~3.4 Regularization epochs).
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

from calm_lightning.errors import ConfigError

PAPER_CALM_VS_REG = 3.4  # CALM paper, Table 10: CALM epoch / Regularization epoch
# Methods whose training step is one pass of a single-level loss, like Regularization's.
SINGLE_LEVEL = {"reg", "ls", "cft"}
CALM_METHODS = {"calm", "calm_stop"}  # the bilevel presets (one LightningModule, calm.py)
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


def split_rows(node) -> int | None:
    """How many rows a data node's split has, from its config (None: only the files know)."""
    split = node.get("split")
    size = None
    if f"{split}_size" in node:  # alpaca-style: train_size / heldout_size / test_size
        size = node.get(f"{split}_size")
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


def _model_label(name, shape) -> str:
    return f"{name} (shape {shape})" if shape else str(name)


def _step(costs: dict, name: str) -> dict | None:
    return costs.get("steps", {}).get(name)


def train_step_cost(job: Job, costs: dict) -> tuple[float, float, str] | None:
    """(seconds, peak MiB, basis) of one training step at the cost file's batch shape."""
    if job.method in SINGLE_LEVEL and _step(costs, "reg"):
        basis = "measured" if job.method == "reg" else "measured (reg step; same one pass)"
        return _step(costs, "reg")["step_s"], _step(costs, "reg")["peak_mb"], basis
    if job.method == "iterate" and _step(costs, "plain") and _step(costs, "forward"):
        plain, forward = _step(costs, "plain"), _step(costs, "forward")
        # A lower step is a plain LoRA step; every lower_steps one upper step adds a forward
        # on a held-out batch (its backward runs through the head only).
        seconds = plain["step_s"] + forward["step_s"] / job.lower_steps
        return seconds, plain["peak_mb"], "composed (plain step + forward / lower_steps)"
    if job.method in CALM_METHODS:
        return _calm_step_cost(job, costs)
    return None


def _calm_step_cost(job: Job, costs: dict):
    if job.schedule == "amortized":
        measured = _step(costs, "amortized")
        if measured and measured.get("surrogate_steps") == job.surrogate_steps:
            return measured["step_s"], measured["peak_mb"], "measured"
    else:
        per_step = [s for s in (_step(costs, "calm"), _step(costs, "per_step")) if s]
        exact = [s for s in per_step if s.get("inner_steps") == job.inner_steps]
        if exact:
            return exact[0]["step_s"], exact[0]["peak_mb"], "measured"
        points = {s["inner_steps"]: s for s in per_step}
        if len(points) >= 2:  # an outer step is linear in T: fit the two measured T
            (t1, s1), (t2, s2) = sorted(points.items())[:2]
            slope = (s2["step_s"] - s1["step_s"]) / (t2 - t1)
            seconds = s1["step_s"] + slope * (job.inner_steps - t1)
            peak = max(s1["peak_mb"], s2["peak_mb"])  # neither schedule's peak grows with T
            return seconds, peak, f"interpolated in T from measured T={t1},{t2}"
    reg = _step(costs, "reg")
    if reg:
        return PAPER_CALM_VS_REG * reg["step_s"], None, "paper (Table 10: 3.4 x reg step)"
    return None


def estimate(job: Job, costs: dict) -> dict:
    """Wall time and peak memory of one job from measured step costs, labelled."""
    measured_tokens = costs["batch"] * costs["seq"]
    scale = job.batch * job.max_length / measured_tokens  # time and activations ~ tokens
    forward = _step(costs, "forward")
    out = {"train_s": 0.0, "eval_s": None, "peak_mb": None, "basis": []}
    if job.train_steps:
        step = train_step_cost(job, costs)
        if step is None:
            out["basis"].append(f"no cost for {job.method} training in the file")
            out["train_s"] = None
        else:
            seconds, peak, basis = step
            out["train_s"] = job.train_steps * seconds * scale
            out["basis"].append(f"train: {basis}, scaled x{scale:.3g} by tokens per batch")
            if peak is not None:
                loaded = _step(costs, "plain")["loaded_mb"]
                out["peak_mb"] = loaded + (peak - loaded) * scale
            if job.method in CALM_METHODS:
                reg = _step(costs, "reg")
                if reg:
                    out["paper_train_s"] = job.train_steps * PAPER_CALM_VS_REG * reg["step_s"]
                    out["paper_train_s"] *= scale
    if forward:
        eval_scale = job.eval_batch / costs["batch"]
        rows = (job.eval_rows or 0) * (2 if job.compare_with_base and job.train_steps else 1)
        if job.method == "ts":
            rows += job.heldout_rows or 0  # the temperature is fitted on held-out forwards
        out["eval_s"] = math.ceil(rows / job.eval_batch) * forward["step_s"] * eval_scale
        out["basis"].append(
            f"eval: {rows} rows x measured forward (rows as long as {costs['seq']} tokens)"
        )
        if out["peak_mb"] is None:
            loaded = forward["loaded_mb"]
            out["peak_mb"] = loaded + (forward["peak_mb"] - loaded) * eval_scale
    if out["train_s"] is not None and out["eval_s"] is not None:
        out["total_s"] = out["train_s"] + out["eval_s"]
    return out


def _hours(seconds) -> str:
    if seconds is None:
        return "?"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def plan(target: str, extra: list[str], costs: dict | None = None) -> list[Job]:
    """Every job `target` launches (in launch order), with estimates when `costs` is given."""
    jobs = [describe(job) for call in sweep_calls(target, extra) for job in expand(call)]
    if costs:
        for job in jobs:
            job.estimate = estimate(job, costs)
    return jobs


def print_plan(jobs: list[Job], costs: dict | None) -> None:
    common = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    print(f"{len(jobs)} jobs; every job has: {' '.join(sorted(common))}")
    if costs:
        model = costs.get("model", {})
        print(
            f"costs: {costs.get('benchmark')} on {costs.get('device')}, model "
            f"{_model_label(model.get('name'), model.get('shape'))} "
            f"({costs.get('shape_parameters') or '?'} parameters), "
            f"batch {costs['batch']} x {costs['seq']} tokens, {costs.get('date')}"
        )
        measured_on = _model_label(model.get("name"), model.get("shape"))
        measured_for = {j.model for j in jobs} - {measured_on}
        if measured_for:
            print(
                f"note: the costs were measured on {measured_on}, the jobs run "
                f"{', '.join(sorted(measured_for))}: measure at the jobs' shape "
                "(model=random model.shape=...) for their numbers"
            )
    print()
    for index, job in enumerate(jobs):
        own = " ".join(o for o in job.overrides if o not in common)
        line = f"#{index:<3d} {job.method:8s} steps {job.train_steps:6d}  {own}"
        if costs:
            e = job.estimate
            peak = f"{e['peak_mb'] / 1024:.1f} GiB" if e.get("peak_mb") else "?"
            basis = "; ".join(e["basis"])
            line += f"\n      time {_hours(e.get('total_s'))}  peak {peak}  ({basis})"
            if "paper_train_s" in e:
                line += f"\n      paper's ratio instead: train {_hours(e['paper_train_s'])}"
        print(line)
    if costs:
        totals = [j.estimate.get("total_s") for j in jobs]
        known = [t for t in totals if t is not None]
        peaks = [j.estimate["peak_mb"] for j in jobs if j.estimate.get("peak_mb")]
        print()
        print(
            f"total: {_hours(sum(known))} on one device for {len(known)} of {len(jobs)} jobs "
            f"({sum(known) / 3600:.2f} device-hours); largest peak "
            f"{max(peaks) / 1024:.1f} GiB"
            if peaks
            else "total: no estimate"
        )


def add_arguments(parser) -> None:
    parser.add_argument("target", help="a multirun_sweeps/*.sh script or +sweep=NAME")
    parser.add_argument("overrides", nargs="*", help="model=NAME and other key=value overrides")
    parser.add_argument("--costs", help="json from benchmarks/calm_step.py --json")


def command(args, parser) -> int:
    """Print the jobs of `args.target` with their estimates."""
    costs = json.loads(Path(args.costs).read_text()) if args.costs else None
    jobs = plan(args.target, args.overrides, costs)
    print(f"plan: {args.target} {shlex.join(args.overrides)}")
    print_plan(jobs, costs)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.plan`: the same as `python -m calm_lightning plan`."""
    from calm_lightning.cli import command_main

    return command_main("plan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
