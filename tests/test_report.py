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
    # mean ± sample std (n - 1) of 0.10 and 0.14, and the t interval of the mean over 2 seeds
    half = 12.7062 * 0.0282843 / np.sqrt(2)
    assert f"0.1200 ± 0.0283 [{0.12 - half:.4f}, {0.12 + half:.4f}]" in report
    assert "52.00% ± 2.83" in report
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
    hyper-parameters; the table shows MCE, ACE and Brier as mean ± sample std over seeds."""
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
    assert choice.std["ace"] == pytest.approx(np.std([0.0, 0.1, 0.2], ddof=1))
    from calm_lightning.reporting.render import markdown_tables

    table = markdown_tables([choice])
    assert "| MCE | ACE | Brier |" in table and "0.0400 ± 0.0200" in table


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
    # Folders as seen from the report's own folder: a shared report names no local path.
    assert "`../sweep`: 1 of 3 finished, 1 unreadable, 1 never started" in text
    assert "never started: `method.module.lower_lr=0.1 method=calm seed=0`" in text
    assert "../sweep/1_m_calm_ood/metrics.json: JSONDecodeError" in text
    assert (
        "the same job twice, counted once: `../sweep/0_m_calm_ood` (kept), "
        "`../older/0_m_calm_ood`" in text
    )
    for name in ("report.md", "results.csv", "selected.csv"):
        assert str(tmp_path) not in (tmp_path / "report" / name).read_text(), name
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


# ----- intervals, paired differences, per-source rows, held-out selection -----


def _scored_run(root: Path, name: str, method: str, probs, labels, heldout=None, seed: int = 0):
    """A finished run with predictions.jsonl and the metrics a run computes from them
    (ci95 and by_source included), and its held-out metrics when given."""
    from calm_lightning.metrics.bootstrap import BootstrapSettings, ScoredQuestions
    from calm_lightning.metrics.by_source import question_spread
    from calm_lightning.metrics.calibration import calibration_report

    run = _fake_run(root, name, method, None, seed=seed)
    sources = ["mmlu", "arc"] * (len(labels) // 2)
    sources[-5:] = ["obqa"] * 5  # a source under 30 questions: marked, kept

    def row(index):
        index = slice(None) if index is None else index
        return ScoredQuestions.from_probs(probs[index], labels[index])

    metrics = calibration_report(probs, labels)
    metrics |= question_spread(row, sources, BootstrapSettings(50, 0, 0))
    payload = {"metrics": metrics, "comparison": {}}
    if heldout is not None:
        payload["heldout"] = {"split": "heldout", "scored": "options", "metrics": heldout}
    (run / "metrics.json").write_text(json.dumps(payload))
    rows = [
        {"id": f"q{i}", "probs": p.tolist(), "label": int(y), "prediction": int(p.argmax())}
        for i, (p, y) in enumerate(zip(probs, labels, strict=True))
    ]
    (run / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _probs(n: int, sharpen: float, seed: int = 0):
    """Labels drawn from softmax(z) (calibrated by construction) and softmax(sharpen * z)."""
    rng = np.random.default_rng(seed)
    logits = 2 * rng.normal(size=(n, 4))
    p = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    labels = (rng.uniform(size=(n, 1)) > np.cumsum(p, 1)).sum(1)
    q = np.exp(sharpen * logits)
    return q / q.sum(1, keepdims=True), labels


def test_report_gives_intervals_paired_differences_and_per_source_rows(tmp_path):
    calibrated, labels = _probs(400, 1.0)
    sharp, _ = _probs(400, 4.0)
    held = {"accuracy": 0.6, "conf_ece": 0.05, "n": 40}
    _scored_run(tmp_path, "base", "base", sharp, labels, held)
    _scored_run(tmp_path, "ts", "ts", calibrated, labels, held)
    out = tmp_path / "rep"
    argv = [str(tmp_path), "--out", str(out), "--select-on", "both", "--resamples", "60"]
    assert report_main(argv) == 0
    text = (out / "report.md").read_text()
    assert "## Selected on the test split (the paper's rule" in text
    assert "## Selected on the held-out split" in text and "| conf_ece (held-out) |" in text
    # every cell with its interval; the AUROC / AURC columns
    assert "| AUROC | AURC | Acc. | seeds |" in text
    ts = json.loads((tmp_path / "ts" / "metrics.json").read_text())["metrics"]
    low, high = ts["ci95"]["conf_ece"]
    assert f"{ts['conf_ece']:.4f} [{low:.4f}, {high:.4f}]" in text
    # ts against base on the same 400 questions: clearly better calibrated
    (line,) = [row for row in text.splitlines() if row.startswith("| ts | -")][:1]
    assert "400 (base)" in line and line.split(" | ")[1].endswith(" *")
    assert "Δ conf-ECE vs base" in text and "Δ AUROC vs ts" in text
    # per-source rows, the small source marked, the macro average
    assert "| ts | obqa (n < 30) |" in text and "| ts | macro |" in text
    with (out / "selected.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert sorted(r["selected_on"] for r in rows) == ["heldout", "heldout", "test", "test"]
    assert float(rows[0]["conf_ece_lo"]) <= float(rows[0]["conf_ece"])


def test_select_on_heldout_names_the_runs_without_held_out_metrics(tmp_path, capsys):
    from calm_lightning.cli import main as cli_main

    probs, labels = _probs(40, 1.0)
    _scored_run(tmp_path, "base", "base", probs, labels, {"accuracy": 0.5, "conf_ece": 0.1})
    _scored_run(tmp_path, "ts", "ts", probs, labels)  # an older run: no `heldout`
    code = cli_main(
        ["report", str(tmp_path), "--out", str(tmp_path / "rep"), "--select-on", "heldout"]
    )
    (message,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert code == 1 and str(tmp_path / "ts") in message and "base" not in message.split(":")[-1]
    assert "evaluation.heldout_metrics=true" in message and "--select-on test" in message


def test_held_out_selection_picks_by_held_out_metrics_and_keeps_feasibility(tmp_path):
    def run(name, method, lr, test_ece, held_ece, held_acc):
        folder = _fake_run(
            tmp_path, name, method, {"accuracy": 0.6, "conf_ece": test_ece}, lower_lr=lr
        )
        payload = json.loads((folder / "metrics.json").read_text())
        payload["heldout"] = {"metrics": {"accuracy": held_acc, "conf_ece": held_ece}}
        (folder / "metrics.json").write_text(json.dumps(payload))

    run("base", "base", 1e-3, 0.2, 0.2, 0.6)
    run("a", "calm", 1e-1, 0.01, 0.30, 0.6)  # best on test, worst held out
    run("b", "calm", 1e-2, 0.09, 0.04, 0.6)  # best held out
    run("c", "calm", 1e-3, 0.08, 0.01, 0.3)  # lowest held-out ECE, accuracy 0.3 <= 0.8 * 0.6
    runs = collect_runs([tmp_path])
    test = {c.method: c for c in select(runs)}["calm"]
    held = {c.method: c for c in select(runs, split="heldout")}["calm"]
    assert test.params == {"method.module.lower_lr": 1e-1} and test.selected_on == "test"
    assert held.params == {"method.module.lower_lr": 1e-2} and held.criterion == 0.04
    assert held.mean["conf_ece"] == 0.09  # the table still shows the test metrics


SOURCES = {"mmlu", "medmcqa", "openbookqa", "arc_challenge"}


@pytest.mark.integration
def test_an_in_domain_sweep_over_the_four_sources_reports_what_held_out_data_selected(
    tmp_path, compose, id_overrides
):
    """The issue's done-when on the hub-schema fixtures and the tiny model: base, ts and reg
    over 2 seeds; every metrics.json has the ranking metrics, intervals, the four sources and
    held-out metrics, and `report --select-on heldout` writes the tables from them."""
    from calm_lightning.pipeline import run_experiment

    setting = [o for o in id_overrides if not o.startswith("setting.train.sizes.")]
    sizes = {"train": 4, "calibration": 4, "test": 8, "ood_test": 4}
    setting += [f"setting.train.sizes.{k}={v}" for k, v in sizes.items()]
    for method in ("base", "ts", "reg"):
        for seed in (0, 1):
            folder = tmp_path / "sweep" / f"{method}_{seed}"
            overrides = [
                "model=tiny",
                "peft.r=4",
                "trainer.enable_progress_bar=false",
                "logger=none",
                "callbacks=none",
                f"method={method}",
                f"seed={seed}",
                *setting,
                "trainer.limit_train_batches=1",
                "trainer.max_epochs=1",
                "evaluation.bootstrap.resamples=200",
            ]
            run_experiment(compose(overrides, folder))
            saved = json.loads((folder / "metrics.json").read_text())
            metrics = saved["metrics"]
            assert {"auroc", "aurc", "sel_acc_80", "ece_em", "smece", "ci95"} <= set(metrics)
            assert set(metrics["by_source"]["sources"]) == SOURCES
            assert saved["heldout"]["metrics"]["n"] == sizes["calibration"]
    out = tmp_path / "report"
    argv = [str(tmp_path / "sweep"), "--out", str(out), "--select-on", "heldout"]
    assert report_main([*argv, "--resamples", "200"]) == 0
    text = (out / "report.md").read_text()
    assert "## Selected on the held-out split" in text and "(held-out) |" in text
    assert "| AUROC | AURC | Acc. | seeds |" in text
    ts_row = next(line for line in text.splitlines() if line.startswith("| ts | "))
    assert (
        "±" in ts_row and "[" in ts_row and ts_row.endswith("| 2 |")
    )  # 2 seeds: mean ± s [lo, hi]
    assert "Δ conf-ECE vs base" in text and "16 (base)" in text  # 2 seeds x 8 questions
    for source in SOURCES:
        assert f"| reg | {source} (n < 30) |" in text
    assert "| reg | macro |" in text
