"""What the pre-trained reference reads: `reference_prompt` plain vs chat, on pairs whose right
temperature is known.

A PoLM made k x over-confident (`model.logit_scale=k`) against the same weights unscaled as
the reference: DACA and Dual-Align should recover T = k. Two pairs:

* `tiny`: the tiny random Llama (`model=tiny`, `reference_model=tiny_plm`) on the post-hoc
  demo setting (`setting=demo_posthoc`, 120 demo questions: 36 fit, 84 test);
* `smollm2`: the embedded SmolLM2-135M-Instruct as PoLM and reference
  (`reference_model=smollm2`) on MMLU test items in the hub schema (`--mmlu-file`, e.g. a
  local `cais/mmlu` test export; `setting=posthoc_mmlu`, 30 % fit / 70 % test).

Each (pair, method, reference_prompt, seed) is one `python -m calm_lightning.run` process;
records go to `results/reference_prompt.json` (resumable: a finished run is not repeated) and
the table to `results/reference_prompt.md`.

    python studies/reference_prompt.py --mmlu-file /data/mmlu_test.jsonl
    python studies/reference_prompt.py --pairs tiny          # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from calm_lightning.runtime.run_record import is_run_dir, read_run

ROOT = Path(__file__).resolve().parents[1]
K = 4.0
METHODS = ("daca", "dual_align")
PROMPTS = ("plain", "chat")


def pair_overrides(pair: str, mmlu_file: str | None) -> list[str]:
    if pair == "tiny":
        return [
            "model=tiny",
            "reference_model=tiny_plm",
            "setting=demo_posthoc",
            "setting.test.source.limit=120",
        ]
    if not mmlu_file:
        sys.exit("--mmlu-file is needed for the smollm2 pair (MMLU test items, hub schema)")
    return [
        "model=smollm2",
        "reference_model=smollm2",
        "setting=posthoc_mmlu",
        f"setting.test.source.sources.mmlu.files=[{Path(mmlu_file).resolve()}]",
        # 300 questions: 90 fit / 210 test (about 5 min a run on 2 CPU cores)
        "setting.test.source.limit=300",
        # DACA and Dual-Align read the option letters' logit lens (no cloze counterpart).
        "evaluation.scoring=letter",
    ]


def run(overrides: list[str], out: Path) -> dict:
    """One run (skipped when `out` already holds a finished one); its metrics.json."""
    if not (is_run_dir(out) and read_run(out).finished):
        cmd = [sys.executable, "-m", "calm_lightning.run", *overrides, f"hydra.run.dir={out}"]
        print("+", " ".join(cmd[2:]), flush=True)
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"run failed ({out}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return read_run(out).summary


def render(records: list[dict], path: Path) -> None:
    lines = [
        f"| pair | method | reference_prompt | seeds | recovered T (right: {K:g}) | |T − k| / k "
        "| agreement | conf-ECE | base conf-ECE |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["pair"], r["method"], r["reference_prompt"]) for r in records})
    for pair, method, prompt in keys:
        rows = [
            r
            for r in records
            if (r["pair"], r["method"], r["reference_prompt"]) == (pair, method, prompt)
        ]

        def cell(key, rows=rows):
            values = [r[key] for r in rows]
            mean = statistics.mean(values)
            spread = f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else ""
            return f"{mean:.3f}{spread}"

        lines.append(
            f"| {pair} | {method} | {prompt} | {len(rows)} | {cell('temperature')} | "
            f"{cell('relative_error')} | {cell('agreement_rate')} | {cell('conf_ece')} | "
            f"{cell('base_conf_ece')} |"
        )
    path.write_text(
        "Mean (± sample std over seeds, n − 1) of each cell; regenerate with "
        "`python studies/reference_prompt.py --mmlu-file <mmlu test jsonl>`, raw records "
        "in `results/reference_prompt.json`.\n\n" + "\n".join(lines) + "\n"
    )
    print("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", nargs="+", default=["tiny", "smollm2"])
    parser.add_argument("--mmlu-file", help="MMLU test items in the cais/mmlu schema (jsonl)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", default=str(ROOT / "outputs" / "reference_prompt"))
    parser.add_argument("--results", default=str(ROOT / "results" / "reference_prompt.json"))
    args = parser.parse_args(argv)
    records = []
    for pair in args.pairs:
        for seed in args.seeds:
            for prompt in PROMPTS:
                for method in METHODS:
                    out = Path(args.out) / pair / f"{method}_{prompt}_s{seed}"
                    # The untouched PoLM is the same in all four runs of a seed: score it once.
                    first = (prompt, method) == (PROMPTS[0], METHODS[0])
                    overrides = [
                        *pair_overrides(pair, args.mmlu_file),
                        f"model.logit_scale={K}",
                        f"method={method}",
                        f"method.module.reference_prompt={prompt}",
                        # one lens cache per (pair, prompt) run folder tree: seeds share it
                        f"method.module.cache_dir={Path(args.out) / pair / 'lens_cache'}",
                        f"seed={seed}",
                        "logger=none",
                        "trainer.enable_progress_bar=false",
                        f"evaluation.compare_with_base={str(first).lower()}",
                    ]
                    summary = run(overrides, out)
                    if first:
                        base = summary["comparison"]["base"]
                    fit = summary["posthoc"]
                    records.append(
                        {
                            "pair": pair,
                            "method": method,
                            "reference_prompt": prompt,
                            "seed": seed,
                            "logit_scale": K,
                            "temperature": fit["temperature"],
                            "relative_error": abs(fit["temperature"] - K) / K,
                            "agreement_rate": fit.get("agreement_rate"),
                            "n_fit": fit.get("n"),
                            "n_test": summary["metrics"]["n"],
                            "accuracy": summary["metrics"]["accuracy"],
                            "conf_ece": summary["metrics"]["conf_ece"],
                            "base_conf_ece": base["conf_ece"],
                            "base_accuracy": base["accuracy"],
                            "run_dir": str(
                                out.relative_to(ROOT) if out.is_relative_to(ROOT) else out
                            ),
                        }
                    )
    results = Path(args.results)
    results.write_text(json.dumps(records, indent=1) + "\n")
    render(records, results.with_suffix(".md"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
