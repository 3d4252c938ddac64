"""The jobs a sweep launches: a sweep script run with a recording stand-in for Python (so its
loops and helpers run for real), each `calm_lightning.run` call expanded by Hydra's own basic
sweeper (its `+sweep=` grid plus the command line's comma lists), each job described from its
composed config (jobs.py) and priced (pricing.py). Nothing here imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from calm_lightning.errors import ConfigError
from calm_lightning.planning import cost_model
from calm_lightning.planning.jobs import Job, compose_run, describe
from calm_lightning.planning.pricing import price
from calm_lightning.runtime.sweep_grid import basic_sweeper_jobs, parse_overrides

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
    jobs, multirun, _ = _expand(overrides)
    return jobs, multirun


def _expand(overrides: list[str]) -> tuple[list[list[str]], bool, int | None]:
    """`expand_call`'s jobs and mode, and the call's launcher time limit in minutes
    (`hydra.launcher.timeout_min`: SLURM's; None for a launcher without one)."""
    from hydra.types import RunMode

    flag = any(o in ("--multirun", "-m") for o in overrides)
    overrides = [o for o in overrides if o not in ("--multirun", "-m")]
    parsed = parse_overrides(overrides)
    task = [o.input_line for o in parsed if not o.get_key_element().startswith("hydra.")]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    hydra_cfg = compose_run(fixed, hydra=True).hydra
    sweeper = str(hydra_cfg.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        raise ConfigError(
            f"{' '.join(overrides)}: the sweeper is {sweeper}, whose jobs are chosen while it "
            "runs (e.g. Optuna's n_trials); only the basic sweeper's grids can be listed"
        )
    multirun = hydra_cfg.mode == RunMode.MULTIRUN or flag
    limit = hydra_cfg.launcher.get("timeout_min")
    limit = int(limit) if limit is not None else None
    if not multirun and not any(o.is_sweep_override() for o in parsed):
        return [task], False, limit
    return basic_sweeper_jobs(hydra_cfg.sweeper.get("params") or {}, task), True, limit


def plan(target: str, extra: list[str], device: str | None = None,
         costs: dict | None = None) -> list[Job]:  # fmt: skip
    """Every job `target` launches (in launch order), each with its estimate on `device`
    (default: the local GPU, else the A100 40G); `costs` (a GPU cost file) replaces the
    assumed utilisation with the measured one."""
    device = device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = []
    for index, call in enumerate(sweep_calls(target, extra)):
        expanded, multirun, limit = _expand(call)
        sweep = _sweep_folder(call, index) if multirun else None
        for overrides in expanded:
            job = describe(overrides, sweep)
            job.call, job.launcher_limit_min = index, limit
            jobs.append(job)
    price(jobs, device, measured)
    return jobs


def _sweep_folder(call: list[str], index: int) -> str:
    """The folder a multirun call's jobs share: its `hydra.sweep.dir`, else (the default
    folder is stamped with the launch time) one of its own."""
    for override in reversed(call):
        if override.startswith("hydra.sweep.dir="):
            return override.split("=", 1)[1]
    return f"call {index}"
