"""Sweeps and reports: the selection rule on fabricated runs with a known answer, tables that
equal their inputs, failed jobs reported, and a real tiny-model multirun with one failing job."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from calm_lightning.report import main as report_main
from calm_lightning.reporting.collect import collect_runs
from calm_lightning.reporting.selection import select


def _fake_run(
    root: Path,
    name: str,
    method: str,
    metrics: dict | None,
    seed: int = 0,
    lower_lr: float = 1e-3,
    base: dict | None = None,
    error: str | None = None,
    openqa: bool = False,
):
    run = root / name
    run.mkdir(parents=True)
    config = {
        "seed": seed,
        "model": {"name": "m"},
        "setting": {"name": "ood"},
        "method": {"name": method, "module": {"lower_lr": lower_lr}},
        "paths": {"output_dir": str(run)},
    }
    OmegaConf.save(OmegaConf.create(config), run / "config_resolved.yaml")
    if metrics is not None and openqa:
        base_metrics = {"accuracy": 0.0, "sem_ece": 0.0, "mean_confidence": 0.0, "n": 10}
        payload = {"metrics": base_metrics | metrics, "comparison": {}}
        (run / "metrics.json").write_text(json.dumps(payload))
    elif metrics is not None:
        full = {
            "accuracy": 0.0,
            "conf_ece": 0.0,
            "cw_ece": 0.0,
            "mce": 0.0,
            "brier": 0.0,
            "nll": 0.0,
            "ace": 0.0,
            "mean_confidence": 0.0,
            "n": 10,
        } | metrics
        payload = {"metrics": full, "comparison": {"base": base} if base else {}}
        (run / "metrics.json").write_text(json.dumps(payload))
    if error:
        (run / "failed.json").write_text(json.dumps({"error": error}))
    return run


def test_selection_rule_respects_the_accuracy_constraint(tmp_path):
    _fake_run(tmp_path, "base", "base", {"accuracy": 0.60, "conf_ece": 0.20, "cw_ece": 0.10})
    # Lowest conf-ECE but accuracy 0.40 < 0.8 * 0.60 = 0.48: not eligible.
    _fake_run(
        tmp_path, "a", "calm", {"accuracy": 0.40, "conf_ece": 0.01, "cw_ece": 0.05}, lower_lr=1e-1
    )
    _fake_run(
        tmp_path, "b", "calm", {"accuracy": 0.55, "conf_ece": 0.08, "cw_ece": 0.07}, lower_lr=1e-2
    )
    _fake_run(
        tmp_path, "c", "calm", {"accuracy": 0.59, "conf_ece": 0.12, "cw_ece": 0.04}, lower_lr=1e-3
    )
    _fake_run(tmp_path, "d", "calm", None, lower_lr=1e-4, error="RuntimeError: boom")
    runs = collect_runs([tmp_path])
    choices = {c.method: c for c in select(runs)}
    assert choices["calm"].params == {"method.module.lower_lr": 1e-2}
    assert choices["calm"].mean["conf_ece"] == 0.08 and choices["calm"].feasible
    # With a looser rule the low-accuracy run wins.
    loose = {c.method: c for c in select(runs, min_accuracy_ratio=0.5)}
    assert loose["calm"].params == {"method.module.lower_lr": 1e-1}


def test_open_qa_runs_are_selected_and_tabled_on_sem_ece(tmp_path):
    _fake_run(tmp_path, "base", "base", {"accuracy": 0.50, "sem_ece": 0.30}, openqa=True)
    # Lowest Sem-ECE but accuracy 0.30 <= 0.8 * 0.5: not eligible.
    _fake_run(
        tmp_path, "a", "calm", {"accuracy": 0.30, "sem_ece": 0.02}, lower_lr=1e-1, openqa=True
    )
    _fake_run(
        tmp_path, "b", "calm", {"accuracy": 0.45, "sem_ece": 0.10}, lower_lr=1e-2, openqa=True
    )
    _fake_run(
        tmp_path, "c", "calm", {"accuracy": 0.48, "sem_ece": 0.20}, lower_lr=1e-3, openqa=True
    )
    assert report_main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    choices = {c.method: c for c in select(collect_runs([tmp_path]))}
    assert choices["calm"].params == {"method.module.lower_lr": 1e-2}
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "| method | Sem-ECE | Acc. | seeds |" in report  # no MCQA-only columns
    assert "| sem_ece | 0.1000 | 45.00% |" in report
    with (tmp_path / "rep" / "selected.csv").open() as handle:
        rows = {r["method"]: r for r in csv.DictReader(handle)}
    assert float(rows["calm"]["sem_ece"]) == pytest.approx(0.10) and rows["calm"]["conf_ece"] == ""
    with (tmp_path / "rep" / "results.csv").open() as handle:
        reader = csv.reader(handle)
        header = next(reader)
        assert all(len(row) == len(header) for row in reader)


def test_seeds_are_averaged_and_tables_equal_the_inputs(tmp_path, capsys):
    for seed, (acc, ece) in enumerate([(0.50, 0.10), (0.54, 0.14)]):
        _fake_run(
            tmp_path,
            f"s{seed}",
            "calm",
            {"accuracy": acc, "conf_ece": ece, "cw_ece": 0.05},
            seed=seed,
            base={"accuracy": 0.6, "conf_ece": 0.3},
        )
    _fake_run(tmp_path, "f", "reg", None, error="ValueError: bad")
    assert report_main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "0.1200 ± 0.0200" in report  # mean ± population std of 0.10 and 0.14
    assert "52.00% ± 2.00" in report
    assert "ValueError: bad" in report  # the failed job is listed, not fatal
    with (tmp_path / "rep" / "selected.csv").open() as handle:
        (row,) = list(csv.DictReader(handle))
    assert float(row["conf_ece"]) == pytest.approx(0.12) and row["n_seeds"] == "2"
    with (tmp_path / "rep" / "results.csv").open() as handle:
        statuses = sorted(r["status"] for r in csv.DictReader(handle))
    assert statuses == ["failed: ValueError: bad", "ok", "ok"]


@pytest.mark.integration
def test_tiny_multirun_sweep_with_a_failing_job_then_report(tmp_path):
    """A 2 x 2 grid through Hydra's basic launcher; one job gets an invalid head kind."""
    args = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        "--multirun",
        "model=tiny",
        "method=calm",
        "peft.r=4",
        "setting.test.limit=8",
        "trainer.limit_train_batches=1",
        "method.module.inner_steps=1",
        "trainer.enable_progress_bar=false",
        "evaluation.compare_with_base=false",
        "logger=none",
        "callbacks=none",
        "method.module.lower_lr=1e-4,1e-3",
        "method.head.kind=vector,wrong",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=600, env=dict(os.environ, HF_HUB_OFFLINE="1")
    )
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 4
    failed = [j for j in jobs if (j / "failed.json").is_file()]
    assert len(failed) == 2 and all((j / "metrics.json").is_file() for j in jobs if j not in failed)
    # refused by the config check, before the job's model was built
    assert (
        "method.head.kind='wrong' is not one of vector, scalar"
        in (failed[0] / "failed.json").read_text()
    )
    assert report_main([str(tmp_path / "sweep")]) == 0
    report = (tmp_path / "sweep" / "report" / "report.md").read_text()
    assert "2 finished runs, 2 failed" in report
    assert (tmp_path / "sweep" / "report" / "reliability_grid.png").is_file()


def test_seeded_posthoc_runs_average_into_one_row_with_all_metrics(tmp_path):
    """Keys that follow the seed (a method's seed, the 30 / 70 split's seed) are not
    hyper-parameters; the table shows MCE, ACE and Brier as mean ± std over seeds."""
    for seed, ece in enumerate((0.02, 0.04, 0.06)):
        run = _fake_run(
            tmp_path, f"d{seed}", "dual_align", {"conf_ece": ece, "ace": 0.1 * seed}, seed=seed
        )
        config = OmegaConf.load(run / "config_resolved.yaml")
        config.method.module.seed = seed
        config.setting.test = {"seed": seed}
        OmegaConf.save(config, run / "config_resolved.yaml")
    (choice,) = select(collect_runs([tmp_path]))
    assert choice.n_seeds == 3 and choice.params == {}
    assert choice.mean["conf_ece"] == pytest.approx(0.04)
    assert choice.std["ace"] == pytest.approx(np.std([0.0, 0.1, 0.2]))
    from calm_lightning.reporting.render import markdown_tables

    table = markdown_tables([choice])
    assert "| MCE | ACE | Brier |" in table and "0.0400 ± 0.0163" in table


def _sweep(root: Path, grid: str) -> Path:
    """A sweep folder as Hydra's basic sweeper leaves it: multirun.yaml with the grid."""
    root.mkdir(parents=True)
    hydra = {
        "sweeper": {
            "_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper",
            "params": {"method.module.lower_lr": grid},
        },
        "overrides": {"task": ["method=calm", "seed=0"]},
    }
    OmegaConf.save(OmegaConf.create({"hydra": hydra}), root / "multirun.yaml")
    return root


def test_report_says_what_a_sweep_lacks_and_counts_a_job_found_twice_once(tmp_path, capsys):
    sweep = _sweep(tmp_path / "sweep", "1e-3,1e-2,1e-1")
    good = {"accuracy": 0.6, "conf_ece": 0.1}
    done = _fake_run(sweep, "0_m_calm_ood", "calm", good, lower_lr=1e-3)
    (done / "job.json").write_text(json.dumps({"digest": "aaaa"}))
    broken = _fake_run(sweep, "1_m_calm_ood", "calm", good, lower_lr=1e-2)
    (broken / "metrics.json").write_text('{"metrics": {"accuracy": 0.')  # cut mid-write
    # job 2 never started; an older copy of job 0 in another folder (killed there)
    other = _fake_run(tmp_path / "older", "0_m_calm_ood", "calm", None, lower_lr=1e-3)
    (other / "job.json").write_text(json.dumps({"digest": "aaaa"}))

    assert report_main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
    text = (tmp_path / "report" / "report.md").read_text()
    assert f"`{sweep}`: 1 of 3 finished, 1 unreadable, 1 never started" in text
    assert "never started: `method.module.lower_lr=0.1 method=calm seed=0`" in text
    assert f"{broken / 'metrics.json'}: JSONDecodeError" in text
    assert f"the same job twice, counted once: `{done}` (kept), `{other}`" in text
    assert "| calm ‡ |" in text and "selected from an incomplete sweep" in text
    # one run, not two seeds of one configuration
    (row,) = list(csv.DictReader((tmp_path / "report" / "selected.csv").open()))
    assert row["method"] == "calm"
    assert "n_seeds" not in row or row["n_seeds"] == "1"


def test_a_finished_copy_left_out_as_a_duplicate_still_counts_in_its_sweep(tmp_path):
    """The same job finished in two sweep folders: one run in the tables, and each sweep says
    its job finished (the copy left out is not an unfinished job)."""
    from calm_lightning.reporting.collect import collect

    for name in ("a", "b"):
        job = _fake_run(_sweep(tmp_path / name, "1e-3"), "0_m_calm_ood", "calm", {"accuracy": 0.6})
        (job / "job.json").write_text(json.dumps({"digest": "same"}))
    collection = collect([tmp_path])
    assert len(collection.runs) == 1 and len(collection.duplicates) == 1
    assert [s.line() for s in collection.sweeps] == [
        f"`{tmp_path / name}`: 1 of 1 finished" for name in ("a", "b")
    ]
