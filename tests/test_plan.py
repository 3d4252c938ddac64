"""`python -m calm_lightning.plan`: the jobs a sweep launches, and their estimated cost."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calm_lightning import plan

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "multirun_sweeps" / "table1_mcqa_ood.sh"
COSTS = ROOT / "benchmarks" / "results" / "calm_step_random_small_cpu.json"


def _grid(name: str, **replace: str) -> set[frozenset]:
    """The jobs of conf/sweep/NAME.yaml by hand: the product of its comma lists (a command-line
    list replaces the grid's list of the same key)."""
    params = dict(OmegaConf.load(ROOT / "conf" / "sweep" / f"{name}.yaml").hydra.sweeper.params)
    params.update(replace)
    axes = [[(key, _value(v)) for v in str(values).split(",")] for key, values in params.items()]
    return {frozenset(combo) for combo in itertools.product(*axes)}


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _swept(job: plan.Job, keys) -> frozenset:
    pairs = dict(o.split("=", 1) for o in job.overrides)
    return frozenset((k, _value(pairs[k])) for k in keys)


@pytest.fixture(scope="module")
def table1():
    costs = json.loads(COSTS.read_text())
    return plan.plan(str(SCRIPT), ["model=tiny"], costs), costs


def test_table1_lists_the_jobs_hydra_expands_from_the_script_grids(table1):
    jobs, _ = table1
    expected = {
        "calm_ood": _grid("calm_ood"),
        "reg": _grid("reg"),
        "iterate": _grid("iterate"),
        "methods": _grid("methods", method="base,ts,cft"),  # the script's method=base,ts,cft
    }
    assert len(jobs) == sum(len(v) for v in expected.values()) == 27
    for grid, combos in expected.items():
        mine = [j for j in jobs if f"+sweep={grid}" in j.overrides]
        keys = {k for combo in combos for k, _ in combo}
        assert {_swept(j, keys) for j in mine} == combos and len(mine) == len(combos), grid
    for job in jobs:
        assert {"model=tiny", "setting=ood"} <= set(job.overrides)
    assert [j.method for j in jobs[-3:]] == ["base", "ts", "cft"]


def test_a_reg_job_costs_its_steps_times_the_measured_step(table1):
    jobs, costs = table1
    job = next(j for j in jobs if j.method == "reg")
    alpaca = OmegaConf.load(ROOT / "conf" / "data" / "alpaca.yaml")
    epochs = OmegaConf.load(ROOT / "conf" / "method_setting" / "reg_ood.yaml").method.epochs
    setting = OmegaConf.load(ROOT / "conf" / "setting" / "ood.yaml")
    steps = math.ceil(alpaca.train_size / setting.batch_size) * epochs
    assert job.train_steps == steps  # 48,002 rows / 16 x 30 epochs (the paper's OOD reg)
    scale = setting.batch_size * setting.max_length / (costs["batch"] * costs["seq"])
    assert job.estimate["train_s"] == pytest.approx(steps * costs["steps"]["reg"]["step_s"] * scale)
    rows = 2 * OmegaConf.load(ROOT / "conf" / "data" / "mcqa.yaml").sizes.ood_test  # + base
    forward = costs["steps"]["forward"]["step_s"] * setting.eval_batch_size / costs["batch"]
    assert job.estimate["eval_s"] == pytest.approx(rows / setting.eval_batch_size * forward)
    base = next(j for j in jobs if j.method == "base")
    assert base.train_steps == 0 and base.estimate["train_s"] == 0


def test_calm_jobs_say_where_their_numbers_come_from(table1):
    jobs, costs = table1
    calm = next(j for j in jobs if j.method == "calm")
    assert calm.schedule == "per_step" and calm.inner_steps == 20
    measured_t = {s.get("inner_steps") for s in costs["steps"].values()}
    basis = calm.estimate["basis"][0]
    assert ("measured" in basis) if 20 in measured_t else ("interpolated" in basis)
    reg_step = costs["steps"]["reg"]["step_s"]
    scale = calm.batch * calm.max_length / (costs["batch"] * costs["seq"])
    assert calm.estimate["paper_train_s"] == pytest.approx(
        calm.train_steps * plan.PAPER_CALM_VS_REG * reg_step * scale
    )


def test_the_command_prints_one_estimate_per_job_and_a_total(capsys):
    assert plan.main(["+sweep=calm_ood", "model=tiny", "--costs", str(COSTS)]) == 0
    out = capsys.readouterr().out
    assert out.count("\n#") == 12 and out.count("      time ") == 12
    assert "paper's ratio instead" in out and "total:" in out and "device-hours" in out


def test_a_script_that_refuses_its_arguments_is_a_clear_error(capsys):
    assert plan.main([str(SCRIPT), "model=tiny", "nonsense"]) == 1
    assert "not an option or a key=value override: nonsense" in capsys.readouterr().err
