"""The per-token calibration study: a miscalibration no temperature can undo, and who undoes it.

The embedded SmolLM2-135M-Instruct with every logit x k (`model.logit_scale=k`) and +b added to
the logits of S+, a seeded half of the test split's option-text tokens
(`model.logit_distortion={bias: b, seed: s}`, docs/posthoc.md; the seed draws S+ and seeds the
run). Cloze scoring (the primary arm: letters put this model near chance). Cells k in {1, 4} x
b in {0, b* = 8k} (b* chosen on the held-out split, docs/posthoc.md "Choosing b*"), settings
`demo_id` (the head trains where the option tokens occur) and `demo` (OOD, the negative
control), seeds 0-2, every method a separate `python -m calm_lightning.run` process on the
demo budget (12 outer steps of batch 4 for every training method, lower LR 1e-4). Rows: ROWS.

Stages, in order (an interrupted study resumes: records already in the results file are
skipped, and a finished run folder is read, not rerun):

0. `select`: calm_token's entry LR (TOKEN_LRS) by the lowest held-out NLL at k = 4, b*, seed 0
   (`setting.test.split=heldout`: the upper level's own questions, whose labels it never reads;
   S+ is then drawn from the held-out options, all inside the support);
1. `key`: the falsification cell (k = 4, b*, demo_id), seeds 0-2, for base, ts, cc_ts, vs,
   oracle and calm_token, and vs / calm_token at b = 0 (the recovery slope's other end);
2. `ablate`: calm_token with one piece changed at a time (ABLATIONS), key cell, seed 0;
3. `rows`: the other rows of the key cell (cc, bc, calm_scalar, calm_vector, calm_stop and the
   frozen-head control), seeds 0-2;
4. `cells`: every row in the other cells of demo_id (`--cells k:b ...` picks which);
5. `ood`: `setting=demo` at k = 4 (b* and 0), every row but OOD_SKIPPED (calm_token and the
   frozen head with `support=responses`: demo's training data has no options).

Every stage runs each seed of `--seeds` (default 0-2; `select` and `ablate` use seed 0), and
`--rows` restricts stages rows, cells and ood to some rows.

`--render-only` writes results/token_calibration.md (tables, recovery, paired bootstraps
against ts and cc_ts, the falsification outcome) and results/token_calibration.png.

    python studies/token_calibration.py --stages key     # the falsification cell (~1 h)
    python studies/token_calibration.py                  # everything (many hours on 2 cores)
    python studies/token_calibration.py --render-only
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

if __package__:  # python -m studies.token_calibration, or imported from the package
    from . import paired_bootstrap, study_runs
else:  # python studies/token_calibration.py: Python puts this folder first on the import path
    import paired_bootstrap
    import study_runs

ROOT = study_runs.ROOT
RESULTS = ROOT / "results" / "token_calibration.json"
BSTAR = 8.0  # b* = 8 k (docs/posthoc.md, "Choosing b*")
SEEDS = (0, 1, 2)
# The demo_id cells (k, b) of stage `cells`, in the order they run (--cells k:b ...).
CELLS = ((4.0, 0.0), (4.0, 4 * BSTAR), (1.0, BSTAR), (1.0, 0.0))
AMORTIZED = {"method.module.surrogate.schedule": "amortized"}
ROWS = {
    "base": {"method": "base"},
    "ts": {"method": "ts"},
    "cc": {"method": "cc"},
    "cc_ts": {"method": "cc_ts"},
    "bc": {"method": "bc"},
    "vs": {"method": "vs"},
    "oracle": {"method": "oracle"},
    # The paper's form with the known-miscalibration study's picks (amortized: per_step's
    # T = 20 costs ~4x as much and ended at the same temperature there).
    "calm_scalar": {"method": "calm", "method.head.kind": "scalar",
                    "method.module.upper_lr": 0.1, **AMORTIZED},
    "calm_vector": {"method": "calm", "method.head.kind": "vector",
                    "method.head.center": "logsumexp", "method.module.upper_lr": 0.05,
                    **AMORTIZED},
    "calm_stop": {"method": "calm_stop"},
    "calm_token": {"method": "calm_token"},
    # The adapters train under calm_token's bilevel step, the head stays the identity.
    "frozen_head": {"method": "calm_token", "method.module.upper_lr": 0.0,
                    "method.module.token_lr": 0.0},
}  # fmt: skip
# One calm_token piece changed at a time (docs/calm.md, "A per-token head"), at the selected
# entry LR, in the falsification cell (k = 4, b*, demo_id) of seed 0; `budget_x4` asks whether
# the entries stop short of the truth for want of steps (48 outer steps instead of 12).
ABLATIONS = {
    "no_entries": {"method.module.token_lr": 0.0},  # the shared temperature alone
    "one_lambda": {"method.module.variant.lambda_blocks": "one"},
    "no_shrinkage": {"method.module.token_weight_decay": 0.0},
    "sign_entries": {"method.module.token_step": "sign"},
    "token_scales": {"method.module.token_scale": True},
    "responses_support": {"method.module.support": "responses"},
    "budget_x4": {"trainer.limit_train_batches": 48},
    # what of budget_x4's gain is the entries', the temperature's, or the adapters' alone
    "budget_x4_no_entries": {"trainer.limit_train_batches": 48, "method.module.token_lr": 0.0},
    "budget_x4_frozen_head": {
        "trainer.limit_train_batches": 48,
        "method.module.token_lr": 0.0,
        "method.module.upper_lr": 0.0,
    },
}
# Paired bootstraps: each row against these (every other ablation against calm_token).
COMPARED_WITH = {
    "calm_token": ("ts", "cc_ts", "calm_stop"),  # calm_stop: the same step without entries
    "vs": ("ts", "cc_ts"),
    # the entries' share at 4x the steps, and cc_ts
    "calm_token-budget_x4": ("calm_token-budget_x4_no_entries", "cc_ts"),
}
HEAD_ROWS = ("vs", "oracle", "calm_scalar", "calm_vector", "calm_stop", "calm_token")
KEY_ROWS = ("base", "ts", "cc_ts", "vs", "oracle", "calm_token")
FALSIFICATION = (
    "Stated before the runs. At (k = 4, b = b*) in demo_id the per-token head adds nothing "
    "beyond TS + contextual calibration if calm_token does not beat cc_ts on NLL and on "
    "accuracy outside the paired 95 % bootstrap interval in at least 2 of 3 seeds, or if its "
    "recovery slope on S+ is below 0.5. If vs itself cannot beat cc_ts, the parametrisation "
    "carries nothing more on this model, whatever CALM does. Targets (mean of 3 seeds): "
    "calm_token closes >= half of the accuracy the distortion removed, beats ts on NLL, "
    "recovers the shift with slope >= 0.5; at b = 0 it loses <= 1 accuracy point against "
    "calm_scalar; oracle reproduces the clean base (accuracy +-0.005, NLL +-1e-3)."
)
# Written before stage `ood` ran (seed 0's S+: 162 of its 219 tokens are among the demo
# instruction answers' tokens, which they make up 27 % of).
OOD_PREDICTION = (
    "Stated before the OOD runs. In setting=demo the adapters and the head train on instruction "
    "data (calm_token's support: the most frequent answer tokens, as no options occur there). "
    "The distortion acts on every forward pass and most S+ tokens occur in those answers, so "
    "demo withholds the option format, not the signal about S+. Prediction: calm_token's "
    "recovery slope on S+ stays below 0.1, as in domain; it beats ts on NLL (its temperature "
    "is fitted on the same held-out text); and it is not better than calm_stop (the same step "
    "without entries) on accuracy outside the paired 95 % interval. "
    "cc_ts and vs do not run there: they fit on labelled held-out questions, which demo lacks."
)
OOD_SKIPPED = ("cc_ts", "vs")  # refused by the methods themselves in setting=demo
# Written after the runs (issue 57), kept in the results file's `note` beside its records.
NOTE = (
    "Added after the runs (issue 57): the falsification rule was unpassable by construction. "
    "For the head to count as adding something, calm_token had to beat cc_ts on NLL and on "
    "accuracy outside the interval in 2 of 3 seeds and recover the shift with slope >= 0.5; the "
    "exact inverse (oracle) itself loses to cc_ts on NLL in the key cell (k = 4, b = 32, "
    "demo_id, 3 seeds: 1.533 against 1.253), because cc_ts also corrects the clean model's own "
    "miscalibration. The rule's outcome rests on the recovery-slope branch alone. That slope is "
    "measured against b/k; at the learned temperature d0 the bias that undoes +b is -d0 * b, "
    "and the share of it recovered is the slope divided by k * d0 (key cell: 0.025 on average "
    "instead of 0.015; 48 steps: 0.086 instead of 0.059)."
)


TOKEN_LRS = (0.3, 1.0, 3.0)  # calm_token's entry LR, chosen on the held-out split (stage select)


def common(k: float, b: float, setting: str, seed: int, split: str = "test") -> dict:
    return {
        **study_runs.EXTRA,
        "setting.test.split": split,
        "model.logit_scale": k,
        "model.logit_distortion": f"{{bias: {b}, seed: {seed}}}",
        "setting": setting,
        "seed": seed,
        "evaluation.scoring": "cloze",
        "evaluation.compare_with_base": "false",
        "trainer.limit_train_batches": 12,
        "setting.max_length": 192,
        "trainer.enable_progress_bar": "false",
    }


def _short(value) -> str:
    """An override's value as a run-folder name part (numbers as %g)."""
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return f"{value:g}" if is_number else str(value).lower()


class Study:
    def __init__(
        self,
        results: Path,
        outputs: Path,
        seeds=SEEDS,
        keep_checkpoints=False,
        cells=CELLS,
        rows=tuple(ROWS),
    ) -> None:
        self.results, self.outputs, self.seeds = results, outputs, seeds
        self.keep_checkpoints, self.cells, self.rows = keep_checkpoints, cells, rows
        self.records = load_records(results)

    def run(self, row, k, b, setting, seed, split="test", extra=None, label=None) -> dict:
        """One run of ROWS[row] (+ `extra`), recorded as method `label` (default: row)."""
        meta = {"setting": setting, "k": k, "b": b, "seed": seed, "method": label or row,
                "split": split}  # fmt: skip
        for record in self.records:
            if all(record.get(key, "test") == value for key, value in meta.items()):
                return record
        extra = dict(extra or {})
        name = row + "".join(f"_{key.rsplit('.', 1)[-1]}{_short(value)}"
                             for key, value in extra.items())  # fmt: skip
        cell = f"{setting}_k{k:g}_b{b:g}_s{seed}" + ("" if split == "test" else f"_{split}")
        run_dir = self.outputs / cell / name
        overrides = {**common(k, b, setting, seed, split), **ROWS[row], **extra}
        payload = study_runs.run(overrides, run_dir)
        metrics = payload["metrics"]
        record = {**meta, **{m: metrics.get(m) for m in (
            "accuracy", "nll", "brier", "conf_ece", "cw_ece", "mean_confidence")},
            "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else
            str(run_dir)}  # fmt: skip
        for extra in ("token_head", "calm_steps", "posthoc"):
            if payload.get(extra):
                record[extra] = payload[extra]
        self.records.append(record)
        save_records(self.results, self.records)
        if not self.keep_checkpoints:  # ~0.5 GB a training run; the record holds what we read
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        return record

    def token_lr(self) -> float:
        """calm_token's entry LR: the lowest held-out NLL over TOKEN_LRS (k = 4, b*, seed 0;
        the held-out split is the upper level's own data, its labels unused there)."""
        rows = [self.run("calm_token", 4.0, 4 * BSTAR, "demo_id", 0, "heldout",
                         {"method.module.token_lr": lr}, f"calm_token_lr{lr:g}")
                for lr in TOKEN_LRS]  # fmt: skip
        best = min(zip(TOKEN_LRS, rows, strict=True), key=lambda pair: pair[1]["nll"])
        return best[0]

    def token_row(self, k, b, setting, seed, extra=None) -> dict:
        """calm_token at the selected entry LR (+ `extra`, which comes first in its folder name)."""
        lr = {"method.module.token_lr": self.token_lr()}
        return self.run("calm_token", k, b, setting, seed, extra={**(extra or {}), **lr})

    def stage(self, name: str) -> None:
        if name == "select":
            self.run("base", 4.0, 4 * BSTAR, "demo_id", 0, "heldout")
            print(f"calm_token: token_lr {self.token_lr():g} (held-out NLL)")
        elif name == "key":
            for seed in self.seeds:
                for row in KEY_ROWS:
                    if row == "calm_token":
                        self.token_row(4.0, 4 * BSTAR, "demo_id", seed)
                    else:
                        self.run(row, 4.0, 4 * BSTAR, "demo_id", seed)
                self.run("vs", 4.0, 0.0, "demo_id", seed)
                self.token_row(4.0, 0.0, "demo_id", seed)
        elif name == "ablate":
            lr = {"method.module.token_lr": self.token_lr()}
            for label, change in ABLATIONS.items():
                self.run("calm_token", 4.0, 4 * BSTAR, "demo_id", 0, extra={**lr, **change},
                         label=f"calm_token-{label}")  # fmt: skip
            # the b = 0 partner of the 48-step run: its recovery slope
            self.run("calm_token", 4.0, 0.0, "demo_id", 0, label="calm_token-budget_x4",
                     extra={**lr, **ABLATIONS["budget_x4"]})  # fmt: skip
        elif name == "rows":
            for seed in self.seeds:
                for row in self.rows:
                    if row != "calm_token":
                        self.run(row, 4.0, 4 * BSTAR, "demo_id", seed)
        elif name == "cells":
            for seed in self.seeds:
                for k, b in self.cells:
                    for row in self.rows:
                        if row == "calm_token":
                            self.token_row(k, b, "demo_id", seed)
                        else:
                            self.run(row, k, b, "demo_id", seed)
        elif name == "ood":
            for seed in self.seeds:
                for b in (4 * BSTAR, 0.0):
                    for row in (row for row in self.rows if row not in OOD_SKIPPED):
                        responses = {"method.module.support": "responses"}  # no options there
                        if row == "calm_token":
                            self.token_row(4.0, b, "demo", seed, extra=responses)
                        elif row == "frozen_head":
                            self.run(row, 4.0, b, "demo", seed, extra=responses)
                        else:
                            self.run(row, 4.0, b, "demo", seed)


# ----- analysis (reads the run folders) -----


def head_of(run_dir: Path):
    """(d, l) of a run's saved head, or None."""
    path = ROOT / run_dir / "calibration" / "logit_adjustment.safetensors"
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    return tensors["scale"], tensors["bias"]


def distortion_of(run_dir: Path) -> dict:
    from calm_lightning.runtime.run_record import read_run

    return read_run(ROOT / run_dir).summary.get("logit_distortion") or {}


def recovery(shifted: dict, clean: dict, option_ids: list[int]) -> dict | None:
    """Slope and RMSE of dl = l(b*) - l(0) against the truth -b/k: on S+, and on the other
    option-text tokens of the test split (truth 0). The slope is through the origin: mean dl
    over S+ divided by -b/k."""
    heads = head_of(Path(shifted["run_dir"])), head_of(Path(clean["run_dir"]))
    if None in heads:
        return None
    (d1, l1), (_, l0) = heads
    if l1.numel() == 1:  # a scalar head: one offset for every token, nothing per token
        return None
    dl = (l1.float() - l0.float()) if l0.numel() == l1.numel() else l1.float() - float(l0)
    truth = -shifted["b"] / shifted["k"]
    s_plus = sorted(distortion_of(Path(shifted["run_dir"]))["token_ids"])
    others = sorted(set(option_ids) - set(s_plus))
    on, off = dl[s_plus], dl[others]
    # S+ tokens the head has an entry for (moved at all): the others never occur in its
    # training or held-out options, so no head of this kind can move them
    covered = on[on != 0]
    return {
        "recovery_slope": float(on.mean()) / truth,
        "recovery_slope_covered": float(covered.mean()) / truth if covered.numel() else None,
        "recovery_rmse": float(((on - truth) ** 2).mean().sqrt()),
        "other_tokens_mean_dl": float(off.mean()),
        "other_tokens_rmse": float((off**2).mean().sqrt()),
        "s_plus_moved": float((on != 0).float().mean()),
        "d_mean_option_tokens": float(d1.float()[option_ids].mean()),
    }


def entry_means(record: dict, s_plus: set, option_ids: list[int]) -> dict | None:
    """Mean fitted bias on S+ and on the other option tokens of one head (no b = 0 partner
    needed: the ablations run at b* only). The truth at b*: -b/k on S+, 0 elsewhere, less
    whatever the clean model's own preferences add (recovery() subtracts those)."""
    head = head_of(Path(record["run_dir"]))
    if head is None:
        return None
    _, bias = head
    on = sorted(s_plus)
    off = sorted(set(option_ids) - s_plus)
    return {"s_plus_mean_l": float(bias.float()[on].mean()),
            "other_mean_l": float(bias.float()[off].mean())}  # fmt: skip


def selection_bias(record: dict, tokenizer, test_by_id: dict, s_plus: set) -> dict:
    """Share of chosen options holding an S+ token, against the share of gold options that do."""
    import yaml

    from calm_lightning.data.cloze_batches import encode_question
    from calm_lightning.runtime.run_record import CONFIG_FILE, read_predictions

    run_dir = ROOT / record["run_dir"]
    cfg = yaml.safe_load((run_dir / CONFIG_FILE).read_text())
    prompt = cfg["evaluation"]["cloze"]["prompt"]
    chosen = gold = 0
    rows = read_predictions(run_dir)
    for row in rows:
        item = test_by_id[row["id"]]
        _, conts, _ = encode_question(tokenizer, item["question"], item["choices"], prompt)
        has = [bool(s_plus & set(c)) for c in conts]
        probs = row["probs"]
        chosen += has[max(range(len(probs)), key=probs.__getitem__)]
        gold += has[int(row["label"])]
    return {"chosen_with_s_plus": chosen / len(rows), "gold_with_s_plus": gold / len(rows)}


def bootstrap(a: dict, b: dict, metric: str) -> dict:
    pa, pb, labels = paired_bootstrap.paired(
        paired_bootstrap.predictions(ROOT / a["run_dir"]),
        paired_bootstrap.predictions(ROOT / b["run_dir"]),
    )
    return paired_bootstrap.compare(pa, pb, labels, metric=metric, resamples=2000)


def load_records(path: Path) -> list[dict]:
    """The study's records: the file is {"note", "records"} (a bare list before the note)."""
    stored = study_runs.load(path)
    return stored["records"] if isinstance(stored, dict) else stored


def save_records(path: Path, records: list[dict]) -> None:
    study_runs.save(path, {"note": NOTE, "records": records})


def render(results: Path, table: Path, figure: Path) -> None:
    records = load_records(results)
    if not records:
        sys.exit(f"no records in {results}")
    tokenizer, test = study_runs.tokenizer_and_test()
    test_by_id = {item["id"]: item for item in test}
    from calm_lightning.data.cloze_batches import encode_question

    option_ids = sorted({i for item in test
                         for c in encode_question(tokenizer, item["question"], item["choices"],
                                                  "chat")[1] for i in c})  # fmt: skip
    by = {(r["setting"], r["k"], r["b"], r["seed"], r["method"]): r
          for r in records if r.get("split", "test") == "test"}  # fmt: skip
    analysis = {"falsification": FALSIFICATION, "ood_prediction": OOD_PREDICTION, "note": NOTE,
                "rows": [], "comparisons": []}  # fmt: skip
    for r in records:
        row = {k: v for k, v in r.items() if k not in ("token_head", "calm_steps", "posthoc")}
        row.update({"token_head": r.get("token_head")} if r.get("token_head") else {})
        dist = distortion_of(Path(r["run_dir"]))
        if dist.get("token_ids") and r["b"] and r.get("split", "test") == "test":
            row.update(selection_bias(r, tokenizer, test_by_id, set(dist["token_ids"])))
        clean = by.get((r["setting"], r["k"], 0.0, r["seed"], r["method"]))
        head_row = r["method"] in HEAD_ROWS or r["method"] == "calm_token-budget_x4"
        if head_row and r["b"] and clean and r.get("split", "test") == "test":
            row.update(recovery(r, clean, option_ids) or {})
        if r["method"].startswith("calm_token") and r["b"] and dist.get("token_ids"):
            row.update(entry_means(r, set(dist["token_ids"]), option_ids) or {})
        analysis["rows"].append(row)
    clean_base = [r for r in records if r["method"] == "base" and r["b"] == 0 and r["k"] == 1]
    analysis["clean_base"] = clean_base[0] if clean_base else None
    for (setting, k, b, seed, method), r in sorted(by.items()):
        ablation = ("calm_token",) if method.startswith("calm_token-") else ()
        refs = COMPARED_WITH.get(method, ablation)
        if b:
            for ref in refs:
                other = by.get((setting, k, b, seed, ref))
                if other:
                    for metric in ("nll", "accuracy"):
                        c = bootstrap(other, r, metric)
                        analysis["comparisons"].append(
                            {"setting": setting, "k": k, "b": b, "seed": seed, "method": method,
                             "against": ref, "metric": metric, "value_against": c["a"],
                             "value": c["b"], "difference": c["difference"],
                             "ci95": c["ci95"], "questions": c["questions"]})  # fmt: skip
    table.with_suffix(".analysis.json").write_text(json.dumps(analysis, indent=1) + "\n")
    table.write_text(markdown(analysis))
    _figure(analysis["rows"], figure)
    print(f"wrote {table}, {table.with_suffix('.analysis.json')} and {figure}")


def _mean(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def markdown(analysis: dict) -> str:
    rows = analysis["rows"]
    lines = ["# Per-token calibration study", "",
             "Regenerate: `python studies/token_calibration.py --render-only` (runs: "
             "`python studies/token_calibration.py`); raw records in "
             "`results/token_calibration.json`, this analysis in "
             "`results/token_calibration.analysis.json`. Test split (held out from every fit).",
             "", "**Falsification.** " + analysis["falsification"],
             "", "**OOD negative control.** " + analysis["ood_prediction"],
             ""]  # fmt: skip
    if analysis.get("note"):
        lines[-1:-1] = ["", "**Note.** " + analysis["note"]]
    cells = sorted({(r.get("split", "test"), r["setting"], r["k"], r["b"]) for r in rows},
                   key=lambda c: (c[0] != "test", c[1:]))  # fmt: skip
    for split, setting, k, b in cells:
        cell = (split, setting, k, b)
        mine = [r for r in rows if (r.get("split", "test"), r["setting"], r["k"], r["b"]) == cell]
        seeds = sorted({r["seed"] for r in mine})
        lines += [f"## {setting}, k = {k:g}, b = {b:g}, {split} split "
                  f"(seeds {', '.join(map(str, seeds))})", "",
                  "| method | n | accuracy | NLL | Brier | conf-ECE | cw-ECE "
                  "| chosen / gold with S+ | recovery slope (covered S+) | RMSE on S+ "
                  "| mean Δl other tokens |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        order = list(ROWS) + sorted({r["method"] for r in mine} - set(ROWS))
        for method in order:
            rs = [r for r in mine if r["method"] == method]
            if not rs:
                continue
            sel = _mean([r.get("chosen_with_s_plus") for r in rs])
            gold = _mean([r.get("gold_with_s_plus") for r in rs])
            lines.append(
                f"| {method} | {len(rs)} | {_mean([r['accuracy'] for r in rs])} | "
                f"{_mean([r['nll'] for r in rs])} | {_mean([r['brier'] for r in rs])} | "
                f"{_mean([r['conf_ece'] for r in rs])} | {_mean([r['cw_ece'] for r in rs])} | "
                f"{sel} / {gold} | {_mean([r.get('recovery_slope') for r in rs])} "
                f"({_mean([r.get('recovery_slope_covered') for r in rs])}) | "
                f"{_mean([r.get('recovery_rmse') for r in rs])} | "
                f"{_mean([r.get('other_tokens_mean_dl') for r in rs])} |"
            )
        lines.append("")
    ablated = [r for r in rows if r["method"].startswith("calm_token") and r["seed"] == 0
               and (r.get("split", "test"), r["setting"], r["k"], r["b"])
               == ("test", "demo_id", 4.0, 4 * BSTAR)]  # fmt: skip
    if any("-" in r["method"] for r in ablated):
        lines += ["## calm_token ablations (demo_id, k = 4, b = 32, seed 0, test split)", "",
                  "One piece changed at a time (ABLATIONS in the script). Mean l̂: the fitted "
                  "bias on S+ and on the other test option tokens (truth at b*: −8 on S+ "
                  "relative to the others).", "",
                  "| variant | accuracy | NLL | conf-ECE | mean l̂ on S+ | mean l̂ other |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for r in sorted(ablated, key=lambda r: ("-" in r["method"], r["method"])):
            lines.append(f"| {r['method']} | {r['accuracy']:.4f} | {r['nll']:.4f} | "
                         f"{r['conf_ece']:.4f} | {_mean([r.get('s_plus_mean_l')])} | "
                         f"{_mean([r.get('other_mean_l')])} |")  # fmt: skip
        lines.append("")
    if analysis["comparisons"]:
        lines += ["## Paired bootstrap (b − a on the same test questions, 95 % "
                  "percentile interval, 2,000 resamples)", "",
                  "| cell | seed | a | b | metric | a | b | b − a | 95 % interval |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for c in analysis["comparisons"]:
            low, high = c["ci95"]
            lines.append(
                f"| {c['setting']} k={c['k']:g} b={c['b']:g} | {c['seed']} | {c['against']} | "
                f"{c['method']} | {c['metric']} | {c['value_against']:.4f} | {c['value']:.4f} | "
                f"{c['difference']:+.4f} | [{low:+.4f}, {high:+.4f}] |"
            )
        lines.append("")
    return "\n".join(lines)


def _figure(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get("split", "test") == "test" and r["method"] in ROWS]
    cells = sorted({(r["setting"], r["k"], r["b"]) for r in rows})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    methods = [m for m in ROWS if any(r["method"] == m for r in rows)]
    width = 0.8 / max(1, len(cells))
    for j, cell in enumerate(cells):
        for ax, metric in zip(axes, ("accuracy", "nll"), strict=True):
            values = []
            for m in methods:
                vs = [r[metric] for r in rows
                      if (r["setting"], r["k"], r["b"]) == cell and r["method"] == m]  # fmt: skip
                values.append(statistics.mean(vs) if vs else float("nan"))
            ax.bar([i + j * width for i in range(len(methods))], values, width,
                   label=f"{cell[0]} k={cell[1]:g} b={cell[2]:g}")  # fmt: skip
    for ax, metric in zip(axes, ("accuracy", "NLL"), strict=True):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=45, ha="right")
        ax.set_ylabel(f"test {metric} (mean over seeds)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _cell(text: str) -> tuple[float, float]:
    """`--cells` items: `k:b`, e.g. 1:8."""
    try:
        k, b = (float(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not k:b (e.g. 1:8)") from None
    return k, b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+",
                        default=["select", "key", "ablate", "rows", "cells", "ood"],
                        choices=["select", "key", "ablate", "rows", "cells", "ood"])  # fmt: skip
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--outputs", type=Path, default=ROOT / "outputs" / "token_calibration")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--cells", nargs="+", type=_cell, default=list(CELLS),
                        help="stage cells: the k:b cells to run, in this order")  # fmt: skip
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                        help="stages rows, cells, ood: run only these rows")  # fmt: skip
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument(
        "--keep-checkpoints",
        action="store_true",
        help="keep each finished run's checkpoints (deleted by default)",
    )
    parser.add_argument("--extra", nargs="*", default=[], help="overrides added to every run")
    args = parser.parse_args()
    study_runs.EXTRA.update(dict(item.split("=", 1) for item in args.extra))
    if not args.render_only:
        runner = Study(args.results, args.outputs, tuple(args.seeds), args.keep_checkpoints,
                       tuple(args.cells), tuple(args.rows))  # fmt: skip
        for name in args.stages:
            runner.stage(name)
    table = args.results.with_suffix(".md")
    render(args.results, table, args.results.with_suffix(".png"))


if __name__ == "__main__":
    main()
