"""The research studies still run, as scripts and as modules of the `studies` package (their
numbers are read by people, not asserted here)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STUDIES = ROOT / "studies"
# The studies that import the shared helpers (study_runs, paired_bootstrap) from their folder.
SHARING = ("known_miscalibration", "token_calibration", "calm_variant", "entropy_equivalence")


def _run(name: str, *args: str, module: bool = False, timeout: int = 300) -> str:
    """`python studies/<name>.py ...`, or `python -m studies.<name> ...` from the root."""
    target = ["-m", f"studies.{name}"] if module else [str(STUDIES / f"{name}.py")]
    done = subprocess.run(
        [sys.executable, *target, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        # The scripts import the package of this checkout, whatever else is installed.
        env=dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _study(name: str):
    """A study module loaded from its file (for the ones that import no sibling)."""
    spec = importlib.util.spec_from_file_location(name, STUDIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_the_studies_find_their_shared_helpers_either_way(module):
    for name in SHARING:
        assert "usage:" in _run(name, "--help", module=module)


def test_no_study_edits_the_import_path():
    for path in STUDIES.glob("*.py"):
        assert "sys.path" not in path.read_text(), path.name


@pytest.mark.system  # a study's smoke run (make test-system)
def test_reference_prompt_benchmark_records_the_known_temperature(tmp_path):
    import json

    results = tmp_path / "reference_prompt.json"
    _run(
        "reference_prompt",
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


@pytest.mark.system  # a study's smoke run (make test-system)
def test_known_miscalibration_renders_mean_and_sample_std_and_the_by_k_figure(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    records = []
    for k in (1.0, 4.0):
        records.append({"logit_scale": k, "setting": "demo", "method": "base", "schedule": None,
                        "seed": 0, "label": None, "accuracy": 0.5, "mean_confidence": 0.9,
                        "conf_ece": 0.2 * k, "cw_ece": 0.1, "effective_temperature": None,
                        "run_dir": None})  # fmt: skip
        for seed in (0, 1, 2):
            records.append({**records[-1 - seed], "method": "calm", "schedule": "per_step",
                            "seed": seed, "accuracy": float(rng.uniform(0.4, 0.6)),
                            "conf_ece": float(rng.uniform(0.1, 0.3)),
                            "effective_temperature": float(rng.uniform(1, 3))})  # fmt: skip
    results = tmp_path / "km.json"
    results.write_text(json.dumps(records))
    out = _run("known_miscalibration", "--render-only", "--results", str(results), module=True)
    for k in (1.0, 4.0):
        calm = [r for r in records if r["method"] == "calm" and r["logit_scale"] == k]
        ece = np.array([r["conf_ece"] for r in calm])
        row = next(line for line in out.splitlines() if line.startswith(f"| {k:g} | OOD | calm"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3] == "3"
        assert cells[6] == f"{ece.mean():.4f} ± {ece.std(ddof=1):.4f}"  # sample std
    assert (tmp_path / "km.md").read_text().strip() == out.strip()
    assert (tmp_path / "km_by_k.png").stat().st_size > 0  # two k in one setting
    assert not (tmp_path / "km.png").exists()  # no run folders: no reliability diagrams


@pytest.mark.system  # a study's smoke run (make test-system)
def test_temperature_profile_at_s_equal_k_is_the_pipelines_k_scaled_base(compose, tmp_path):
    """One pass of the unscaled model gives the option probabilities at any scale s; at s = k
    they must be what the pipeline scores for the model whose final norm weight is x k."""
    import numpy as np

    from calm_lightning.metrics.calibration import confidence_ece
    from calm_lightning.pipeline import run_experiment

    profile = _study("temperature_profile").profile
    common = ["model=tiny", "peft.r=4", "method=base", "setting=demo", "setting.test.limit=8",
              "setting.eval_batch_size=4", "evaluation.scoring=cloze",
              "evaluation.cloze.prompt=plain", "trainer.enable_progress_bar=false"]  # fmt: skip
    scales = [1.0, 2.5]
    rows, probs = profile(compose([*common, "model.logit_scale=1"], tmp_path / "p"), scales)
    for k, row, mine in zip(scales, rows, probs, strict=True):
        out = tmp_path / f"k{k}"
        run_experiment(compose([*common, f"model.logit_scale={k}"], out))
        scored = [json.loads(line) for line in (out / "predictions.jsonl").open()]
        theirs = np.array([r["probs"] for r in scored])
        assert mine.shape == (8, 4) and np.abs(mine - theirs).max() < 1e-5
        labels = np.array([r["label"] for r in scored])
        assert abs(row["conf_ece"] - confidence_ece(mine, labels)) < 1e-12
        assert abs(row["mean_confidence"] - theirs.max(1).mean()) < 1e-5
    assert np.abs(probs[0] - probs[1]).max() > 1e-2  # the scale matters


@pytest.mark.system  # a study's smoke run (make test-system)
def test_paired_bootstrap_matches_a_hand_resampled_difference(tmp_path):
    """The script's standard error of conf-ECE(b) − conf-ECE(a) is the spread of that
    difference over questions resampled with replacement, the same questions for both runs."""
    import numpy as np

    from calm_lightning.metrics.calibration import confidence_ece

    rng = np.random.default_rng(3)
    labels = rng.integers(0, 4, 200)
    logits = rng.normal(size=(200, 4)) + 1.5 * np.eye(4)[labels]
    pa = np.exp(3 * logits) / np.exp(3 * logits).sum(1, keepdims=True)  # over-confident
    pb = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    for name, p in (("a", pa), ("b", pb)):
        (tmp_path / name).mkdir()
        rows = [{"id": f"q{i}", "probs": p[i].tolist(), "label": int(labels[i])}
                for i in range(200)]  # fmt: skip
        rows = rows[::-1] if name == "b" else rows  # paired by id, not by line
        text = "".join(json.dumps(r) + "\n" for r in rows)
        (tmp_path / name / "predictions.jsonl").write_text(text)
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    out = _run("paired_bootstrap", a, b, "--resamples", "1000")
    diff = confidence_ece(pb, labels) - confidence_ece(pa, labels)
    assert f"b - a  {diff:+.4f}" in out
    se = float(out.split("s.e. ")[1].split(",")[0])
    mine = []
    for _ in range(1000):
        i = rng.integers(0, 200, 200)
        mine.append(confidence_ece(pb[i], labels[i]) - confidence_ece(pa[i], labels[i]))
    assert abs(se - np.std(mine)) < 0.15 * np.std(mine)
    low, high = (float(x) for x in out.split("interval [")[1].split("]")[0].split(", "))
    assert low < diff < high and high - low > 2 * se
    same = _run("paired_bootstrap", a, a, "--resamples", "50")
    assert "b - a  +0.0000  paired bootstrap s.e. 0.0000" in same


def _weight_delta(run_dir: Path) -> dict:
    """Adapted matrix -> (alpha / r) B A, formed in full (the study never forms it)."""
    from safetensors.torch import load_file

    folder = Path(run_dir) / "calibration" / "adapter"
    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    scale = config["lora_alpha"] / config["r"]
    delta = {}
    for name, a in tensors.items():
        if ".lora_A." in name:
            b = tensors[name.replace(".lora_A.", ".lora_B.")]
            delta[name.split(".lora_A.")[0]] = scale * b.double() @ a.double()
    return delta


@pytest.mark.system  # a study's smoke run (make test-system)
def test_entropy_equivalence_smoke_predicts_alpha_from_the_frozen_runs_lambda(tmp_path):
    import torch

    results = tmp_path / "ee.json"
    args = ("--smoke", "--seeds", "0", "--arms", "calm_frozen", "reg_lambda",
            "--results", str(results), "--outputs", str(tmp_path / "runs"))  # fmt: skip
    _run("entropy_equivalence", *args, timeout=900)
    doc = json.loads(results.read_text())
    assert {"H1", "H2", "H3", "H4"} <= set(doc["hypotheses"])
    assert "adapter cosine ≥ 0.9" in doc["hypotheses"]["H1"]["statement"]
    rows = {r["arm"]: r for r in doc["rows"]}
    assert set(rows) == {"calm_frozen", "reg_lambda"}  # no references without calm_vector
    frozen, reg = rows["calm_frozen"], rows["reg_lambda"]
    # lambda-bar is metrics.json's mean; the per-step series comes from the CSV log
    assert len(frozen["lambda_t"]) == 2
    assert frozen["lambda_mean"] == pytest.approx(sum(frozen["lambda_t"]) / 2, rel=1e-6)
    assert frozen["head_travel"] == 0.0  # upper LR 0
    assert reg["alpha"] == pytest.approx(1 / frozen["lambda_mean"], rel=1e-12)
    assert reg["overrides"]["method.module.entropy_on"] == "heldout"
    chosen = frozen["overrides"]["method.module.lower_lr"]
    assert chosen == reg["overrides"]["method.module.lr"] and chosen in (1e-3, 1e-2)
    assert len(doc["selection"]) == 3  # base and calm_vector at both lower LRs, held-out
    # the adapter cosine against the full weight deltas, formed here
    a, b = _weight_delta(frozen["run_dir"]), _weight_delta(reg["run_dir"])
    flat_a = torch.cat([a[m].reshape(-1) for m in sorted(a)])
    flat_b = torch.cat([b[m].reshape(-1) for m in sorted(a)])
    cosine = float(flat_a @ flat_b / (flat_a.norm() * flat_b.norm()))
    assert doc["adapter_cosine"]["0"] == pytest.approx(cosine, abs=1e-9)
    pairs = {(c["a"], c["b"], c["metric"]) for c in doc["comparisons"]}
    assert pairs == {("calm_frozen", "reg_lambda", m) for m in ("conf_ece", "nll", "accuracy")}
    assert all(o["verdict"] == "inconclusive" and o["why"] for o in doc["outcomes"].values())
    assert "## Outcomes" in results.with_suffix(".md").read_text()
    assert results.with_suffix(".png").stat().st_size > 0
    again = _run("entropy_equivalence", *args, timeout=300)  # resumable: nothing reruns
    assert "+ calm_lightning.run" not in again


@pytest.mark.system  # a study's render (make test-system)
def test_entropy_equivalence_outcomes_follow_the_stated_rules(tmp_path):
    """Hand-made rows and intervals (no run folders): each hypothesis's verdict."""
    seeds, metrics = (0, 1, 2), ("conf_ece", "nll", "accuracy")
    rows = [{"arm": arm, "k": 1.0, "seed": seed, "accuracy": 0.48, "nll": 1.5, "conf_ece": 0.2,
             "head_travel": 2e-4, "run_dir": "missing"}
            for arm in ("calm_vector", "calm_scalar", "calm_frozen", "reg_lambda", "sft",
                        "reg_paper") for seed in seeds]  # fmt: skip
    rows.append({"arm": "base", "k": 1.0, "seed": 0, "accuracy": 0.5, "nll": 1.5,
                 "conf_ece": 0.25, "run_dir": "missing"})  # fmt: skip
    comparisons = []

    def interval(a, b, metric, seed, low, high):
        comparisons.append({"k": 1.0, "seed": seed, "a": a, "b": b, "metric": metric,
                            "value_a": 0.2, "value_b": 0.2, "difference": (low + high) / 2,
                            "standard_error": 0.01, "ci95": [low, high]})  # fmt: skip

    for seed in seeds:
        for metric in metrics:
            for a, b in (("calm_frozen", "reg_lambda"), ("calm_vector", "reg_lambda"),
                         ("calm_frozen", "calm_vector")):  # fmt: skip
                interval(a, b, metric, seed, -0.01, 0.01 if seed else -0.001)  # 0 in 2 of 3
            # H2: NLL consistently lower for the scalar head in two seeds
            low = -0.002 if metric == "nll" and seed < 2 else -0.01
            interval(
                "calm_vector", "calm_scalar", metric, seed, low, -0.001 if low > -0.01 else 0.01
            )
            if seed < 2:  # H4: seed 2 missing, one seed of two with 0 inside
                interval("sft", "reg_paper", metric, seed, -0.01, 0.01 if seed == 0 else -0.005)
        interval("ts", "calm_vector", "conf_ece", seed, -0.05, -0.01 if seed else 0.01)  # H3
    doc = {"rows": rows, "comparisons": comparisons,
           "adapter_cosine": {"0": 0.95, "1": 0.97, "2": 0.92}}  # fmt: skip
    results = tmp_path / "ee.json"
    results.write_text(json.dumps(doc))
    _run("entropy_equivalence", "--render-only", "--results", str(results))
    out = json.loads(results.read_text())["outcomes"]
    assert out["H1"]["verdict"] == "held" and "min 0.920" in out["H1"]["why"]
    assert out["H2"]["verdict"] == "falsified"
    assert "calm_vector vs calm_scalar nll: 0 inside in 1 of 3 seeds" in out["H2"]["why"]
    assert out["H3"]["verdict"] == "held"  # seeds 1 and 2, accuracy 0.48 >= 0.8 x 0.5
    assert out["H4"]["verdict"] == "inconclusive" and "[2]" in out["H4"]["why"]


@pytest.mark.system  # a study's render (make test-system)
def test_entropy_equivalence_other_k_is_stated_before_its_runs_and_judged_alone(tmp_path):
    """k = 2 gets the same rules, on record before its runs, judged on its own rows only."""
    results = tmp_path / "ee.json"
    _run("entropy_equivalence", "--hypotheses-only", "--k", "2", "--results", str(results))
    stated = json.loads(results.read_text())
    cell = stated["other_k"]["2"]
    assert "unchanged" in cell["rule"] and cell["stated"] and not stated["rows"]
    # k = 1 agrees everywhere; k = 2 (the same intervals) has adapter cosine 0.5 in seed 1
    comparisons, pairs = [], []
    for k in (1.0, 2.0):
        for seed in (0, 1, 2):
            for a, b in (("calm_frozen", "reg_lambda"), ("calm_vector", "reg_lambda"),
                         ("calm_frozen", "calm_vector")):  # fmt: skip
                for metric in ("conf_ece", "nll", "accuracy"):
                    comparisons.append({"k": k, "seed": seed, "a": a, "b": b, "metric": metric,
                                        "value_a": 0.2, "value_b": 0.2, "difference": 0.0,
                                        "standard_error": 0.01, "ci95": [-0.01, 0.01]})  # fmt: skip
            pairs.append({"k": k, "seed": seed, "a": "calm_frozen", "b": "reg_lambda",
                          "cosine": 0.5 if (k, seed) == (2.0, 1) else 0.95,
                          "relative_difference": 0.3})  # fmt: skip
    stated.update(comparisons=comparisons, adapter_pairs=pairs,
                  adapter_cosine={"0": 0.95, "1": 0.95, "2": 0.95},
                  rows=[{"arm": "calm_frozen", "k": k, "seed": 0, "accuracy": 0.5, "nll": 1.5,
                         "conf_ece": 0.2, "run_dir": "missing"} for k in (1.0, 2.0)])  # fmt: skip
    results.write_text(json.dumps(stated))
    _run("entropy_equivalence", "--render-only", "--results", str(results))
    out = json.loads(results.read_text())
    assert out["outcomes"]["H1"]["verdict"] == "held"
    assert out["other_k"]["2"]["stated"] == cell["stated"]  # kept as first recorded
    k2 = out["other_k"]["2"]["outcomes"]
    assert k2["H1"]["verdict"] == "falsified" and "0.500" in k2["H1"]["why"]
    assert "## Outcomes at k = 2" in results.with_suffix(".md").read_text()
