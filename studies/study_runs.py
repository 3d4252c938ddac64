"""What the studies share: one run per `python -m calm_lightning.run` process, the records a
results file holds, and the known-miscalibration protocol that calm_variant reuses.

Module state: EXTRA holds the overrides every run of this process gets (a study's `--model` /
`--extra`), so a smoke run on `model=tiny` reaches each run and the tokenizer it is scored with.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from calm_lightning.runtime.run_record import is_run_dir, read_run

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"demo": "OOD", "demo_id": "ID"}
EXTRA: dict = {}  # --model / --extra: overrides added to every run (smoke runs on model=tiny)


def run(overrides: dict, out: Path) -> dict:
    """One `python -m calm_lightning.run` process; returns its metrics.json."""
    if not (is_run_dir(out) and read_run(out).finished):
        args = [f"{k}={v}" for k, v in overrides.items()]
        cmd = [sys.executable, "-m", "calm_lightning.run", *args, f"hydra.run.dir={out}"]
        print("+", " ".join(cmd[2:]), flush=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        start = time.time()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"run failed ({out}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
        print(f"  done in {time.time() - start:.0f} s", flush=True)
    return read_run(out).summary


def miscalibration_overrides(k: float, setting: str, seed: int, split: str) -> dict:
    """The known-miscalibration protocol's overrides of one run: logits x k and the demo
    budget, the same for every method."""
    return {
        **EXTRA,
        "model.logit_scale": k,
        "setting": setting,
        "seed": seed,
        "setting.test.split": split,
        "evaluation.compare_with_base": "false",
        "trainer.limit_train_batches": 12,  # the demo budget, the same for every method
        "setting.max_length": 192,
        "trainer.enable_progress_bar": "false",
    }


def effective_temperature(run_dir: Path, payload: dict, tokenizer, test_records) -> float | None:
    """TS: its T. A head: 1 / (mean of d over the option-text tokens of the test questions,
    each token as often as it occurs; the plain cloze prompt's continuations). None without
    a head (base, reg)."""
    posthoc = payload.get("posthoc") or {}
    if "temperature" in posthoc:
        return float(posthoc["temperature"])
    head_file = run_dir / "calibration" / "logit_adjustment.safetensors"
    if not head_file.is_file():
        return None
    from safetensors.torch import load_file

    from calm_lightning.data.cloze_batches import encode_question

    d = load_file(str(head_file))["scale"]
    if d.numel() == 1:
        return 1.0 / float(d)
    ids = []
    for record in test_records:
        _, conts, _ = encode_question(tokenizer, record["question"], record["choices"], "plain")
        ids.extend(i for cont in conts for i in cont)
    return 1.0 / float(d[ids].mean())


def record_of(cell: dict, payload: dict, run_dir: Path, temperature) -> dict:
    """One results record: the cell's keys, the run's metrics, its T_eff and its folder."""
    metrics = payload["metrics"]
    out = {
        **cell,
        "accuracy": metrics["accuracy"],
        "mean_confidence": metrics.get("mean_confidence"),
        "conf_ece": metrics["conf_ece"],
        "cw_ece": metrics.get("cw_ece"),
        "brier": metrics.get("brier"),
        "nll": metrics.get("nll"),
        "effective_temperature": temperature,
        "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else None,
    }
    steps = payload.get("calm_steps")
    if steps:
        out["calm_steps"] = steps
    return out


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.is_file() else []


def save(path: Path, records: list[dict]) -> None:
    """Written whole through a temporary file, so an interrupted study keeps its records."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    tmp.replace(path)


def tokenizer_and_test():
    """The tokenizer the runs score with and the demo MCQA test records."""
    from transformers import AutoTokenizer

    from calm_lightning.models import embedded

    if EXTRA.get("model") == "tiny":
        location = embedded.ensure_tokenizer(os.environ.get("CALM_LIGHTNING_CACHE"))
    else:
        location = embedded.ensure_converted(os.environ.get("CALM_LIGHTNING_CACHE"))
    tokenizer = AutoTokenizer.from_pretrained(str(location))
    path = ROOT / "calm_lightning" / "data" / "demo" / "mcqa_test.jsonl"
    return tokenizer, [json.loads(line) for line in path.read_text().splitlines() if line]


def mean_std(values: list[float]) -> str:
    """Mean ± sample std (n − 1), four decimals; one value alone."""
    import statistics

    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"
