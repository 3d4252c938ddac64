"""Where each method of the known-miscalibration study lands on the base model's own
temperature curve.

A model made k x over-confident (`model.logit_scale=k`) and then given an effective temperature
T scores every token with softmax((k / T) z), z the unscaled logits. So, up to what the
adapters change, every row of the study is the base model at one scale s = k / T_eff, and
the test split's conf-ECE as a function of s is one curve shared by every k. This script
scores the test split once with the unscaled model (one pass: cloze option log-likelihoods
and, per option, the sums of logsumexp(s z) at every s on a grid, exactly as
`evaluation/cloze_temperature.py` does for a temperature fit), then gives accuracy, mean
confidence and conf-ECE at each s, and places the study's records on the curve.

Checks printed with the table: at s = k (no temperature) the curve must give the study's
base rows, and at s = k / T the TS rows; both are scored by the pipeline from a model whose
final norm weight is multiplied by k, an independent computation.

    python studies/temperature_profile.py   # the demo test split (~10 min on 2 busy cores)
    python studies/temperature_profile.py -- --results results/known_miscalibration.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def scales_for(records: list[dict]) -> list[float]:
    """A log grid from 0.1 to 8, the unscaled model (s = 1) and every scale the study's
    records sit at."""
    import numpy as np

    grid = {round(float(s), 6) for s in np.logspace(-1, np.log10(8), 61)} | {1.0}
    for r in records:
        grid.add(round(float(r["logit_scale"]), 6))
        if r.get("effective_temperature"):
            grid.add(round(r["logit_scale"] / r["effective_temperature"], 6))
    return sorted(grid)


def profile(cfg, scales: list[float]) -> tuple[list[dict], list]:
    """Accuracy, mean confidence and conf-ECE of the unscaled model at each scale s, and the
    option probabilities (questions x options) they were computed from."""
    import lightning as L
    import torch
    from tqdm import tqdm

    from calm_lightning.evaluation.cloze_temperature import temperature_terms
    from calm_lightning.evaluation.scorers import ClozeScorer, scorer_from_config
    from calm_lightning.metrics.calibration import accuracy, confidence_ece
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model
    from calm_lightning.pipeline import build_datamodule

    scorer = scorer_from_config(cfg.evaluation)
    if not isinstance(scorer, ClozeScorer):
        sys.exit("error: the profile follows cloze scoring (evaluation.scoring=cloze)")
    L.seed_everything(cfg.seed, verbose=False)  # as the pipeline: a random-init model's weights
    loaded = load_language_model(cfg.model)
    model = CalibratedLM(loaded.model, None).eval()
    datamodule = build_datamodule(cfg, scorer, loaded.tokenizer)
    records = datamodule.load_records()["test"]
    size = cfg.setting.eval_batch_size
    grid = torch.tensor(scales, dtype=torch.float64)
    loglik, lse, lengths = [], [], []
    for start in tqdm(range(0, len(records), size), desc="scoring", unit="batch"):
        batch = records[start : start + size]
        scores, terms = temperature_terms(
            model, loaded.tokenizer, [r.question for r in batch], [r.choices for r in batch],
            grid, scorer.prompt, cfg.setting.eval_max_length,
        )  # fmt: skip
        loglik.append(scores.loglik)
        lse.append(terms)
        lengths.append({"none": None, "tokens": scores.n_tokens, "chars": scores.n_chars}[
            scorer.normalize])  # fmt: skip
    loglik, lse = torch.cat(loglik), torch.cat(lse)
    labels = torch.tensor([r.answer for r in records])
    rows, all_probs = [], []
    for i, s in enumerate(scales):
        logits = s * loglik - lse[..., i]  # log-likelihood of each option under softmax(s z)
        if lengths[0] is not None:
            logits = logits / torch.cat(lengths).clamp(min=1)
        probs = torch.softmax(logits, dim=-1).numpy()
        all_probs.append(probs)
        rows.append({
            "scale": s,
            "accuracy": accuracy(probs, labels.numpy()),
            "mean_confidence": float(probs.max(1).mean()),
            "conf_ece": confidence_ece(probs, labels.numpy(), cfg.evaluation.n_bins),
        })  # fmt: skip
    return rows, all_probs


def main() -> None:
    argv = sys.argv[1:]
    if "--" not in argv and {"-h", "--help"} & set(argv):
        argv = ["--", *argv]  # no Hydra overrides: the help is the script's own
    overrides, rest = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default="results/known_miscalibration.json")
    parser.add_argument("--out", default="results/temperature_profile.json")
    parser.add_argument("--setting", default="demo", help="the study's cells of this setting")
    args = parser.parse_args(rest)

    from hydra import compose, initialize_config_module

    import calm_lightning.runtime.resolvers  # noqa: F401  (registers resolvers)

    with initialize_config_module("calm_lightning.conf", version_base="1.3"):
        cfg = compose(
            "run",
            overrides=["method=base", "paths.output_dir=/tmp/unused", f"setting={args.setting}",
                       *overrides, "model.logit_scale=1"],
        )  # fmt: skip
    study = [r for r in json.loads((ROOT / args.results).read_text())
             if r["setting"] == args.setting]  # fmt: skip
    rows, probs = profile(cfg, scales_for(study))
    n = len(probs[0])
    at = {round(r["scale"], 6): r for r in rows}
    best = min(rows, key=lambda r: r["conf_ece"])
    low = f"lowest conf-ECE {best['conf_ece']:.4f} at s = {best['scale']:.3f}"
    print(f"{n} test questions; {low} (temperature {1 / best['scale']:.2f} on the unscaled model)")
    print("| k | method | seed | s = k / T_eff | conf-ECE (run) | conf-ECE (curve at s) |")
    print("|---|---|---|---|---|---|")
    placed = []
    for r in sorted(study, key=lambda r: (r["logit_scale"], r["method"], str(r["schedule"]))):
        t = 1.0 if r["method"] == "base" else r.get("effective_temperature")
        if not t:
            continue
        s = round(r["logit_scale"] / t, 6)
        name = r["method"] + (f" {r['schedule']}" if r["schedule"] else "")
        name += f" ({r['label']})" if r["label"] else ""
        placed.append({"logit_scale": r["logit_scale"], "method": name, "seed": r["seed"],
                       "scale": s, "conf_ece": r["conf_ece"], "accuracy": r["accuracy"],
                       "curve_conf_ece": at[s]["conf_ece"]})  # fmt: skip
        print(f"| {r['logit_scale']:g} | {name} | {r['seed']} | {s:.3f} | {r['conf_ece']:.4f} "
              f"| {at[s]['conf_ece']:.4f} |")  # fmt: skip
    out = ROOT / args.out
    out.write_text(json.dumps({"setting": args.setting, "n_questions": n, "curve": rows,
                               "study": placed}, indent=1) + "\n")  # fmt: skip
    _figure(rows, placed, out.with_suffix(".png"), args.setting)
    print(f"wrote {out} and {out.with_suffix('.png').name}")


MARKERS = {"base": "o", "ts": "s", "reg": "v", "calm per_step": "P", "calm amortized": "D",
           "calm amortized (frozen_head)": "x"}  # fmt: skip


def _figure(rows: list[dict], placed: list[dict], path: Path, setting: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 4.0))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot([r["scale"] for r in rows], [r["conf_ece"] for r in rows], color="black",
            linewidth=1, label="base model at scale s (conf-ECE)")  # fmt: skip
    ax.plot([r["scale"] for r in rows], [r["accuracy"] for r in rows], color="grey",
            linewidth=1, linestyle=":", label="base model at scale s (accuracy)")  # fmt: skip
    colours = {k: f"C{i}" for i, k in enumerate(sorted({p["logit_scale"] for p in placed}))}
    seen = set()
    for p in placed:
        label = f"{p['method']}, k = {p['logit_scale']:g}"
        ax.scatter(p["scale"], p["conf_ece"], marker=MARKERS.get(p["method"], "*"),
                   color=colours[p["logit_scale"]], s=36,
                   label=None if label in seen else label)  # fmt: skip
        seen.add(label)
    best = min(rows, key=lambda r: r["conf_ece"])
    ax.axvline(best["scale"], color="grey", linewidth=0.6, linestyle="--",
               label=f"lowest conf-ECE (s = {best['scale']:.2f})")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xlabel("s = k / T_eff (scale on the unscaled logits)", fontsize=8)
    ax.set_ylabel("test split", fontsize=8)
    ax.set_title(f"SmolLM2-135M-Instruct, setting={setting}: one temperature curve, every k",
                 fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
