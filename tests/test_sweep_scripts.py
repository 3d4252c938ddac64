"""The paper scripts in multirun_sweeps/: valid bash, a --help that names the paper table, only
grids that exist, a failing run command stops the script, and one real script end to end on the
tiny model (grids -> one folder -> report)."""

from __future__ import annotations

import csv
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calm_lightning.runtime.run_record import is_run_dir

ROOT = Path(__file__).parents[1]
SWEEPS = ROOT / "multirun_sweeps"
SCRIPTS = sorted(p for p in SWEEPS.glob("*.sh") if p.name != "lib.sh")
GRIDS = ROOT / "conf" / "sweep"


def _env() -> dict:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    offline = dict(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    return dict(os.environ, PYTHONPATH=path, **offline)


def _bash(*args, timeout: int = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
        cwd=ROOT,
    )


# lib.sh helpers that run one grid for every model.
GRID_HELPERS = {"run_posthoc_reference": "posthoc_reference"}


def _grids_run(script: Path) -> set[str]:
    """The +sweep= grids a script passes to run_grid (directly or through a lib.sh helper)."""
    text = script.read_text()
    grids = set(re.findall(r"run_grid\s+\S+\s+(\w+)", text))
    return grids | {grid for helper, grid in GRID_HELPERS.items() if f"{helper} " in text}


def _paper_table(script: Path) -> str:
    """table12_head_ablation.sh -> 'CALM paper, Table 12'; dual_align_table1_mmlu.sh ->
    'Dual-Align paper, Table 1'."""
    match = re.match(r"(dual_align_)?table(\d+)_", script.name)
    assert match, f"{script.name}: name it table<N>_... or dual_align_table<N>_..."
    paper = "Dual-Align paper" if match.group(1) else "CALM paper"
    return f"{paper}, Table {match.group(2)}"


def test_the_paper_scripts_are_there():
    names = {p.name for p in SCRIPTS}
    assert {"table1_mcqa_ood.sh", "table2_mcqa_id.sh", "table12_head_ablation.sh"} <= names
    assert not os.access(SWEEPS / "lib.sh", os.X_OK)  # sourced, not run


@pytest.mark.integration
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_and_its_help_names_its_table_and_grids(script):
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    syntax = _bash("-n", script)
    assert syntax.returncode == 0, syntax.stderr
    done = _bash(script, "--help")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: {script.name}")
    assert _paper_table(script) in done.stdout
    # The help lists exactly the grids the script runs.
    assert set(re.findall(r"\+sweep=(\w+)", done.stdout)) == _grids_run(script)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_grid_a_script_uses_exists(script):
    grids = _grids_run(script) | set(re.findall(r"\+sweep=(\w+)", script.read_text()))
    assert grids, f"{script.name} runs no grid"
    missing = sorted(g for g in grids if not (GRIDS / f"{g}.yaml").is_file())
    assert not missing, f"{script.name}: no conf/sweep/<name>.yaml for {missing}"


@pytest.mark.integration
def test_bad_arguments_and_a_run_that_cannot_start_stop_the_script(tmp_path):
    script = SWEEPS / "table12_head_ablation.sh"
    for args in (["--bogus"], ["model=tiny"], ["notakeyvalue"], ["--model"]):
        done = _bash(script, *args)
        assert done.returncode == 2 and "table12_head_ablation:" in done.stderr, args
    out = tmp_path / "out"
    # An unknown key makes Hydra refuse the command before any job starts.
    done = _bash(
        script,
        *("--model", "tiny", "--python", sys.executable, "--out", out),
        "setting=demo",
        "no_such_key=1",
        timeout=300,
    )
    assert done.returncode != 0
    assert "+sweep=head_ablation (model=tiny) failed to run" in done.stderr
    assert not (out / "report").exists()


def _jobs_in_grid(grid: str) -> int:
    params = OmegaConf.load(GRIDS / f"{grid}.yaml").hydra.sweeper.params
    return math.prod(len(str(values).split(",")) for values in params.values())


@pytest.mark.integration
def test_head_ablation_script_end_to_end_on_the_tiny_model(tmp_path):
    """The smallest comparison script: its grid into <out>/<model>/<grid>, then one report."""
    out = tmp_path / "t12"
    done = _bash(
        SWEEPS / "table12_head_ablation.sh",
        *("--model", "tiny", "--python", sys.executable, "--out", out),
        "setting=demo",
        "setting.test.limit=4",
        "trainer.limit_train_batches=1",
        "method.module.inner_steps=1",
        "peft.r=2",
        "logger=csv",
        "callbacks=none",
        "trainer.enable_progress_bar=false",
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p for p in (out / "tiny" / "head_ablation").iterdir() if is_run_dir(p))
    assert len(jobs) == _jobs_in_grid("head_ablation") == 2
    assert (out / "report" / "report.md").is_file()
    with (out / "report" / "results.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(jobs)
    assert [r["status"] for r in rows] == ["ok"] * len(jobs)
    assert {r["params"] for r in rows} == {
        '{"method.head.kind": "vector"}',
        '{"method.head.kind": "scalar"}',
    }
    assert "| tiny | demo | calm |" in (out / "report" / "report.md").read_text()


def _recording_python(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in for the scripts' Python: `-m calm_lightning plan` runs for real (a script asks
    it for each grid's SLURM limits), every other call is only recorded, one line each."""
    log, wrapper = tmp_path / "calls.txt", tmp_path / "python"
    wrapper.write_text(
        "#!/usr/bin/env bash\n"
        "if [[ $1 == -m && $2 == calm_lightning && $3 == plan ]]; then\n"
        f'    exec {sys.executable} "$@"\n'
        "fi\n"
        f"printf '%s\\n' \"$*\" >> {log}\n"
    )
    wrapper.chmod(0o755)
    return wrapper, log


def _run_calls(log: Path) -> dict[str, dict[str, str]]:
    """Each recorded `calm_lightning.run` call's overrides, by its grid."""
    calls = {}
    for line in log.read_text().splitlines():
        words = line.split()
        if words[:2] == ["-m", "calm_lightning.run"]:
            pairs = dict(w.split("=", 1) for w in words[2:] if "=" in w)
            calls[pairs["+sweep"]] = pairs
    return calls


@pytest.mark.integration
def test_under_slurm_each_grid_gets_the_limit_and_requeues_its_own_jobs_need(tmp_path):
    """hydra/launcher=slurm: each grid's call carries the time limit and requeues the plan
    gives its longest job (one limit per multirun): Tulu's reg jobs (30 epochs, 41 h on an A100
    40G; tests/test_plan.py works it by hand) 5 requeues of the 720-minute limit, the short
    grids a shorter limit; the same grids without SLURM get nothing added."""
    from calm_lightning import plan
    from calm_lightning.planning.pricing import calls_of, launcher_limits

    python, log = _recording_python(tmp_path)
    script = SWEEPS / "table1_mcqa_ood.sh"
    done = _bash(script, "--model", "tulu", "--python", python, "--out", tmp_path / "out",
                 "--device", "a100_40g", "hydra/launcher=slurm", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    calls = _run_calls(log)
    assert calls["reg"]["hydra.launcher.timeout_min"] == "720"
    assert calls["reg"]["hydra.launcher.max_num_timeout"] == "5"
    jobs = plan.plan(str(script), ["model=tulu"], "a100_40g")
    for members in calls_of(jobs).values():
        grid = next(o for o in members[0].overrides if o.startswith("+sweep=")).split("=")[1]
        limits = launcher_limits(members)
        assert calls[grid]["hydra.launcher.timeout_min"] == str(limits["timeout_min"]), grid
        assert calls[grid]["hydra.launcher.max_num_timeout"] == str(limits["max_num_timeout"])
    assert int(calls["calm_ood"]["hydra.launcher.timeout_min"]) < 720  # about 1.2 h
    # the revision warning, once per model
    assert done.stderr.count("WARN model=tulu has no pinned revision") == 1
    # a limit the user passes wins, and the requeues are counted in it
    log.unlink()
    done = _bash(script, "--model", "tulu", "--python", python, "--out", tmp_path / "out",
                 "--device", "a100_40g", "hydra/launcher=slurm",
                 "hydra.launcher.timeout_min=2880", timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    reg = _run_calls(log)["reg"]
    assert reg["hydra.launcher.timeout_min"] == "2880"  # given once, by the user
    assert log.read_text().count("hydra.launcher.timeout_min=") == 6  # once per grid
    assert reg["hydra.launcher.max_num_timeout"] == "2"  # ceil(3,089 / 2,880)
    # without SLURM nothing is planned or added
    log.unlink()
    done = _bash(script, "--model", "tulu", "--python", python, "--out", tmp_path / "out")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hydra.launcher" not in log.read_text()


def test_a_revision_override_for_several_models_is_refused(tmp_path):
    """A commit belongs to one repository: one `model.revision=` for a script's several models
    would pin them all to it. The one place to pin is each model's conf/model/<name>.yaml."""
    done = _bash(SWEEPS / "table1_mcqa_ood.sh", "--model", "tulu,olmo2", "--python", "echo",
                 "--out", tmp_path, "model.revision=" + "0" * 40)  # fmt: skip
    assert done.returncode == 2
    assert "pin each in its conf/model/<name>.yaml (revision:)" in done.stderr
