"""The benchmark scripts still run (their numbers are read by people, not asserted here)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_calm_step_benchmark_runs_on_the_tiny_model():
    out = _run(
        "calm_step.py",
        *("--model", "tiny", "--inner-steps", "2", "--steps", "1"),
        *("--repeats", "1", "--seq", "32", "--batch", "2", "--no-epoch"),
    )
    assert "time ratio" in out and "memory ratio" in out


def test_calm_epoch_benchmark_runs_on_the_tiny_model():
    out = _run(
        "calm_step.py",
        *("--model", "tiny", "--epoch-inner-steps", "3", "--steps", "1", "--epoch-only"),
        *("--seq", "32", "--batch", "2", "--epoch-batches", "20"),
    )
    assert "epoch ratio vs reg, N=   20" in out and "peak memory amortized" in out
    assert any("amortized ratio" in line for line in out.splitlines())


def test_sampling_benchmark_runs_on_the_tiny_model():
    out = _run(
        "sampling.py",
        *("--model", "tiny", "--questions", "2", "--samples", "3", "--max-new-tokens", "4"),
    )
    assert "speed-up vs 3 generate calls" in out


def test_cloze_scoring_benchmark_runs_on_the_tiny_model():
    out = _run(
        "cloze_scoring.py",
        *("--model", "tiny", "--questions", "3", "--batch", "2", "--repeats", "1"),
    )
    assert "time ratio separate / shared" in out
    difference = float(out.rsplit("log-likelihoods:", 1)[1])
    assert difference < 1e-4


def test_calm_runs_summary_reads_a_real_run(tmp_path, compose):
    import json

    from calm_lightning.pipeline import run_experiment

    runs = []
    for seed in (0, 1):
        out = tmp_path / f"tiny_s{seed}"
        overrides = ["model=tiny", "peft.r=4", "trainer.max_steps=3", "setting.test.limit=8"]
        overrides += [f"seed={seed}", "logger=csv", "trainer.enable_progress_bar=false"]
        run_experiment(compose(overrides, out))
        runs.append(out)
    table = _run("calm_runs.py", *map(str, runs))
    metrics = json.loads((runs[0] / "metrics.json").read_text())["metrics"]
    row = next(line for line in table.splitlines() if line.startswith("| tiny_s0 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "3"  # outer steps logged
    assert cells[3] == f"{metrics['conf_ece']:.3f}"
    assert cells[5] == f"{metrics['mean_confidence']:.3f}"
    assert "| tiny (n=2) |" in table  # seeds grouped by label


def test_reference_prompt_benchmark_records_the_known_temperature(tmp_path):
    import json

    results = tmp_path / "reference_prompt.json"
    _run(
        "reference_prompt.py",
        *("--pairs", "tiny", "--seeds", "0", "--out", str(tmp_path / "runs")),
        *("--results", str(results)),
    )
    records = json.loads(results.read_text())
    assert {(r["method"], r["reference_prompt"]) for r in records} == {
        (m, p) for m in ("daca", "dual_align") for p in ("plain", "chat")
    }
    for record in records:
        if record["reference_prompt"] == "chat":  # the same input: T = k exactly
            assert abs(record["temperature"] - record["logit_scale"]) < 1e-3
    assert "| tiny | daca | chat |" in results.with_suffix(".md").read_text()


@pytest.mark.slow
def test_base_cache_benchmark_runs_on_the_tiny_model():
    out = _run("base_cache.py", "--jobs", "2", "--limit", "8")
    assert "wall-time ratio with / without cache" in out
    assert "base rows byte-identical with and without the cache: True" in out
