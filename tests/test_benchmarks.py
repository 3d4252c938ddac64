"""The benchmark scripts still run (their numbers are read by people, not asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calm_lightning.models.loading import load_language_model
from calm_lightning.models.shapes import SHAPES, parameter_count

ROOT = Path(__file__).resolve().parents[1]


def _run(script: str, *args: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        # The scripts import the package of this checkout, whatever else is installed.
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _lora_parameters(model, r: int) -> int:
    """r x (in + out) per adapted linear layer: every linear layer but the output layer."""
    return sum(
        r * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name != "lm_head"
    )


@pytest.mark.integration
def test_calm_step_benchmark_runs_on_the_tiny_model_and_writes_its_costs(tmp_path):
    out = _run(
        "calm_step.py",
        *("--model", "tiny", "--tokenizer", "bytes", "--inner-steps", "2", "--steps", "1"),
        *("--repeats", "1", "--seq", "32", "--batch", "2", "--no-epoch"),
        *("--json", str(tmp_path / "costs.json")),
    )
    assert "time ratio" in out and "memory ratio" in out
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert set(costs["steps"]) == {"plain", "calm", "forward"}
    assert costs["steps"]["calm"]["inner_steps"] == 2 and costs["batch"] == 2
    loaded = load_language_model(costs["model"])
    base = sum(p.numel() for p in loaded.model.parameters())
    for step in costs["steps"].values():
        assert step["trainable"] == _lora_parameters(loaded.model, r=64)
        assert step["parameters"] == base + step["trainable"]
        assert step["step_s"] > 0 and step["peak_mb"] >= step["loaded_mb"] > 0
    ratio = costs["steps"]["calm"]["step_s"] / (costs["steps"]["plain"]["step_s"] * 5)
    assert costs["ratios"]["time"] == pytest.approx(ratio)
    assert f"{ratio:.3f}" in out


@pytest.mark.slow
def test_calm_step_benchmark_runs_on_a_random_shape_with_both_schedules(tmp_path):
    out = _run(
        "calm_step.py",
        *("--model", "random", "--shape", "small", "--tokenizer", "bytes", "--steps", "1"),
        *("--repeats", "1", "--seq", "32", "--batch", "2", "--inner-steps", "2"),
        *("--epoch-inner-steps", "2", "--epoch-batches", "20"),
        *("--json", str(tmp_path / "costs.json")),
        timeout=1800,  # nine worker processes, each loading the model
    )
    assert "amortized ratio" in out and "per_step ratio" in out
    costs = json.loads((tmp_path / "costs.json").read_text())
    assert set(costs["steps"]) == {"plain", "calm", "reg", "per_step", "amortized", "forward"}
    assert costs["shape_parameters"] == parameter_count(SHAPES["small"])
    plain = costs["steps"]["plain"]
    assert plain["parameters"] - plain["trainable"] == costs["shape_parameters"]


@pytest.mark.system  # whole epochs of each schedule (~50 s)
def test_calm_epoch_benchmark_runs_on_the_tiny_model():
    out = _run(
        "calm_step.py",
        *("--model", "tiny", "--epoch-inner-steps", "3", "--steps", "1", "--epoch-only"),
        *("--seq", "32", "--batch", "2", "--epoch-batches", "20"),
    )
    assert "epoch ratio vs reg, N=   20" in out and "peak memory amortized" in out
    assert any("amortized ratio" in line for line in out.splitlines())


@pytest.mark.integration
def test_sampling_benchmark_runs_on_the_tiny_model():
    out = _run(
        "sampling.py",
        *("--model", "tiny", "--questions", "2", "--samples", "3", "--max-new-tokens", "4"),
    )
    assert "speed-up vs 3 generate calls" in out


@pytest.mark.integration
def test_cloze_scoring_benchmark_runs_on_the_tiny_model():
    out = _run(
        "cloze_scoring.py",
        *("--model", "tiny", "--questions", "3", "--batch", "2", "--repeats", "1"),
    )
    assert "time ratio separate / shared" in out
    difference = float(out.rsplit("log-likelihoods:", 1)[1])
    assert difference < 1e-4


@pytest.mark.integration
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


@pytest.mark.slow
def test_base_cache_benchmark_runs_on_the_tiny_model():
    out = _run("base_cache.py", "--jobs", "2", "--limit", "8")
    assert "wall-time ratio with / without cache" in out
    assert "base rows byte-identical with and without the cache: True" in out
