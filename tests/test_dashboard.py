"""The sweep's W&B dashboard: the saved views' definitions checked against the sweep's runs
(their W&B ids, swept keys and the pick the paper's rule makes, worked out here by hand),
with no network."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb_workspaces")

from calm_lightning import report  # noqa: E402
from calm_lightning.methods.calm import STEP_SERIES  # noqa: E402
from calm_lightning.reporting.dashboard import DASHBOARD_FILE  # noqa: E402
from calm_lightning.runtime.run_record import (  # noqa: E402
    METRICS_FILE,
    Evaluation,
    RunResult,
    read_wandb_id,
    write_config,
    write_run,
    write_wandb_id,
)

BASE = {"accuracy": 0.5, "conf_ece": 0.30}
# upper_lr -> the CALM row: 0.1 has the lowest conf-ECE but keeps only 0.35 / 0.5 = 70 % of
# the base accuracy (<= 80 %): infeasible, so the rule picks 0.05.
GRID = {
    0.01: {"accuracy": 0.50, "conf_ece": 0.20},
    0.05: {"accuracy": 0.45, "conf_ece": 0.10},
    0.1: {"accuracy": 0.35, "conf_ece": 0.05},
}


def _write_run(folder: Path, cfg, metrics: dict, run_id: str) -> None:
    write_config(folder, cfg)
    evaluation = Evaluation({"metrics": metrics, "method": cfg.method.name}, [])
    rows = {"base": BASE, cfg.method.name: metrics}
    write_run(RunResult(folder, evaluation, rows))
    write_wandb_id(folder, run_id)


def _accessors(panel: dict) -> list[str]:
    return [c["accessor"] for c in panel["config"]["columns"]]


def _filter_ids(spec: dict) -> list[str]:
    (runset,) = spec["view"]["spec"]["section"]["runSets"]
    (rule,) = runset["filters"]["filters"]
    assert rule["key"] == {"section": "run", "name": "name"} and rule["op"] == "IN"
    return rule["value"]


def _panels(spec: dict) -> list[dict]:
    sections = spec["view"]["spec"]["section"]["panelBankConfig"]["sections"]
    return [p for s in sections for p in s["panels"]]


def test_views_name_every_run_and_mark_the_pick(tmp_path, compose, capsys):
    sweep = tmp_path / "2026-01-01_00-00-00"
    common = ["model=tiny", "setting=demo", "logger=wandb"]
    ids = {}
    for job, (lr, metrics) in enumerate(GRID.items()):
        cfg = compose([*common, "method=calm", f"method.module.upper_lr={lr}"], "x")
        ids[lr] = f"calm{job}"
        _write_run(sweep / f"{job}_calm", cfg, metrics, ids[lr])
    ts = compose([*common, "method=ts"], "x")
    _write_run(sweep / "3_ts", ts, {"accuracy": 0.5, "conf_ece": 0.12}, "ts0")
    # A run not logged with W&B is not in the views.
    _write_run(
        sweep / "4_base", compose(["model=tiny", "setting=demo", "method=base"], "x"), BASE, ""
    )

    assert report.main([str(sweep)]) == 0
    assert str(sweep / DASHBOARD_FILE) in capsys.readouterr().out
    definition = json.loads((sweep / DASHBOARD_FILE).read_text())
    assert definition["sweep"] == sweep.name and definition["project"] == "calm-lightning"
    on_disk = {read_wandb_id(p) for p in sweep.iterdir() if read_wandb_id(p)}
    assert {r["id"] for r in definition["runs"]} == on_disk == {*ids.values(), "ts0"}
    assert definition["picked"] == {"tiny/demo/calm": [ids[0.05]], "tiny/demo/ts": ["ts0"]}
    # Each run by its folder as seen from the sweep's: no local path in a shareable file.
    assert sorted(r["path"] for r in definition["runs"]) == ["0_calm", "1_calm", "2_calm", "3_ts"]
    assert str(tmp_path) not in (sweep / DASHBOARD_FILE).read_text()

    views = {v["name"]: v for v in definition["views"]}
    calm = views[f"{sweep.name} · tiny / demo / calm"]
    assert sorted(_filter_ids(calm)) == sorted(ids.values())
    parallel = [p for p in _panels(calm) if p["viewType"] == "Parallel Coordinates Plot"]
    (parallel,) = parallel
    # The swept key as W&B addresses the nested config, then the method's summary metrics
    # (the keys publish_results writes: "<method>/<metric>").
    assert _accessors(parallel) == [
        "config:method.value.module.upper_lr",
        "summary:calm/conf_ece",
        "summary:calm/accuracy",
    ]
    (runset,) = calm["view"]["spec"]["section"]["runSets"]
    assert len(runset["pinnedRunIds"]) == 1 and runset["baselineRunId"] == runset["pinnedRunIds"][0]
    colors = calm["view"]["spec"]["section"]["customRunColors"]
    assert colors[ids[0.05]] != colors[ids[0.01]] == colors[ids[0.1]]

    picked = views[f"{sweep.name} · picked"]
    assert sorted(_filter_ids(picked)) == sorted([ids[0.05], "ts0"])
    panels = _panels(picked)
    (media,) = [p for p in panels if p["viewType"] == "Media Browser"]
    assert media["config"]["mediaKeys"] == ["reliability"]
    lines = [p["config"]["metrics"] for p in panels if p["viewType"] == "Run History Line Plot"]
    assert lines == [[s] for s in STEP_SERIES]


def test_publish_without_wandb_runs_is_refused(tmp_path, compose):
    folder = tmp_path / "run"
    _write_run(folder, compose(["model=tiny", "method=base"], "x"), BASE, "")
    with pytest.raises(SystemExit):
        report.main([str(folder), "--publish"])
    assert not (folder / DASHBOARD_FILE).exists()


@pytest.mark.slow
def test_offline_wandb_sweep_report_writes_the_views(tmp_path):
    """The command line end to end: a 3-job CALM multirun logged to W&B offline, then the
    report, whose views name every run of the sweep and the pick."""
    sweep = tmp_path / "sweep"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", WANDB_SILENT="true")
    args = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        "--multirun",
        "model=tiny",
        "method=calm",
        "peft.r=4",
        "setting=demo",
        "setting.test.limit=8",
        "trainer.limit_train_batches=1",
        "method.module.inner_steps=1",
        "trainer.enable_progress_bar=false",
        "logger=wandb",
        "logger.wandb.offline=true",
        "method.module.upper_lr=0.01,0.05,0.1",
        f"hydra.sweep.dir={sweep}",
    ]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if (p / METRICS_FILE).is_file())
    assert len(jobs) == 3
    assert report.main([str(sweep)]) == 0
    definition = json.loads((sweep / DASHBOARD_FILE).read_text())
    assert {r["id"] for r in definition["runs"]} == {read_wandb_id(j) for j in jobs}
    # The pick by hand: lowest conf-ECE among runs above 80 % of their base accuracy.
    rows = [json.loads((j / METRICS_FILE).read_text())["comparison"] for j in jobs]
    feasible = [
        i for i, r in enumerate(rows) if r["calm"]["accuracy"] > 0.8 * r["base"]["accuracy"]
    ] or list(range(3))
    best = min(feasible, key=lambda i: rows[i]["calm"]["conf_ece"])
    assert definition["picked"] == {"tiny/demo/calm": [read_wandb_id(jobs[best])]}
    names = [v["name"] for v in definition["views"]]
    assert names == [f"{sweep.name} · tiny / demo / calm", f"{sweep.name} · picked"]
