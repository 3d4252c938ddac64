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
