"""CALM with a stopping point (`method=calm_stop`) against the paper's form, on the
known-miscalibration study's protocol (studies/known_miscalibration.py).

The embedded SmolLM2-135M-Instruct with every logit x k (`model.logit_scale=k`), `setting=demo`
(OOD analogue), 12 outer steps of batch 4, lower LR 1e-4, each run its own
`python -m calm_lightning.run` process. Stages, in the order they run (an interrupted run
resumes: records already in the results file are skipped):

1. `select`: the variant's upper LR on the held-out MCQA split (never the test split) at
   k = 4, seed 0, over UPPER_LRS, by the paper's rule (lowest conf-ECE keeping >= 0.8 x the
   held-out base accuracy, read from results/known_miscalibration_selection.json). The same
   runs give T_eff across a 10x upper-LR range (the head does not depend on the split scored);
2. `main`: the chosen variant on the test split at k in KS, seed 0 first, with the paper form's
   per_step reproduction at k = 4 and the base / TS-OOD runs the paired bootstrap needs;
3. `budget`: 48 outer steps (held-out split) against 12, and upper LR 3;
4. `ablation`: at k = 4, seed 0, test split: the paper's form (scalar head, upper LR 0.1,
   amortized) with each switch alone, and the paper's vector head under the variant;
   `leave_one_out` (last): the variant with each switch back at the paper's value;
5. `in_domain`: the variant at k = 4 on `setting=demo_id`;
6. `seeds`: seeds 1 and 2 of every k.

Records go to `results/calm_variant.json` (each with logit_scale, setting, variant, head,
upper_lr, outer_steps, seed, split, label, accuracy, conf_ece, effective_temperature, ...);
`--render-only` writes the table `results/calm_variant.md`, the paired bootstraps
`results/calm_variant_bootstrap.json` (where the run folders exist) and the figure
`results/calm_variant.png`. Paper-form rows at other k come from
results/known_miscalibration.json (the same protocol, committed).

    python studies/calm_variant.py                       # everything (~2 h on 2 cores)
    python studies/calm_variant.py --stages select main  # the first stages only
    python studies/calm_variant.py --render-only
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

if __package__:  # python -m studies.calm_variant, or imported from the package
    from . import paired_bootstrap, study_runs
else:  # python studies/calm_variant.py: Python puts this folder first on the import path
    import paired_bootstrap
    import study_runs

ROOT = study_runs.ROOT
VARIANT = "calm_stop"
UPPER_LRS = (0.1, 0.3, 1.0)  # the selection grid: a 10x range in log-space travel per step
KS = (4.0, 2.0, 8.0, 1.0)
LONG = 48  # outer steps of the budget check (against the study's 12)
# The paper form's committed k = 4 OOD row (known_miscalibration.json, per_step, seed 0): the
# scalar head at upper LR 0.1, T = 20.
PAPER = {"method": "calm", "method.module.inner_steps": 20, "method.head.kind": "scalar",
         "method.module.upper_lr": 0.1, "method.module.surrogate.schedule": "per_step"}  # fmt: skip
# Each switch alone on the paper form (the study's amortized schedule, as its selection grid).
ABLATION = {
    "log_head": {"method.head.parameterization": "log"},
    "joint_value": {"method.module.variant.value_function": "joint"},
    "per_block_lambda": {"method.module.variant.lambda_blocks": "per_block"},
    "sign_step": {"method.module.variant.head_step": "sign"},
}
# The variant with each switch turned back to the paper's value (at the variant's upper LR).
LEAVE_ONE_OUT = {
    "without_log_head": {"method.head.parameterization": "linear"},
    "without_joint_value": {"method.module.variant.value_function": "lower"},
    "without_per_block_lambda": {"method.module.variant.lambda_blocks": "one"},
    "without_sign_step": {"method.module.variant.head_step": "adamw"},
}
STAGES = ("select", "main", "budget", "ablation", "in_domain", "seeds", "leave_one_out")


def outer_steps(overrides: dict) -> int:
    return int(overrides.get("trainer.limit_train_batches", 12))


def job(k, setting, seed, split, variant, label, overrides, outputs: Path) -> tuple[dict, Path]:
    meta = {
        "logit_scale": k, "setting": setting, "variant": variant, "seed": seed, "split": split,
        "label": label, "overrides": overrides,
        "head": overrides.get("method.head.kind", "scalar" if variant == VARIANT else None),
        "upper_lr": overrides.get("method.module.upper_lr"), "outer_steps": outer_steps(overrides),
    }  # fmt: skip
    tag = label or variant
    name = f"k{k:g}_{setting}_{split}/{tag}_lr{meta['upper_lr']}_n{meta['outer_steps']}_s{seed}"
    return meta, outputs / name


def variant_overrides(upper_lr: float, steps: int = 12) -> dict:
    out = {"method": VARIANT, "method.module.upper_lr": upper_lr}
    if steps != 12:
        out["trainer.limit_train_batches"] = steps
    return out


class Study:
    def __init__(self, results: Path, outputs: Path) -> None:
        self.results, self.outputs = results, outputs
        self.records = study_runs.load(results)
        self.tokenizer, self.test_records = study_runs.tokenizer_and_test()

    def done(self, meta: dict) -> dict | None:
        key = json.dumps({k: v for k, v in meta.items() if k != "head"}, sort_keys=True)
        for r in self.records:
            mine = {k: r.get(k) for k in meta if k != "head"}
            if json.dumps(mine, sort_keys=True) == key:
                return r
        return None

    def run(self, k, setting, seed, split, variant, label, overrides) -> dict:
        meta, run_dir = job(k, setting, seed, split, variant, label, overrides, self.outputs)
        found = self.done(meta)
        if found:
            return found
        # the protocol sets the study's 12 steps; variant_overrides says otherwise when it differs
        protocol = study_runs.miscalibration_overrides(k, setting, seed, split)
        payload = study_runs.run({**protocol, **overrides}, run_dir)
        temperature = study_runs.effective_temperature(
            run_dir, payload, self.tokenizer, self.test_records
        )
        record = study_runs.record_of(meta, payload, run_dir, temperature)
        self.records.append(record)
        study_runs.save(self.results, self.records)
        return record

    def select(self) -> float:
        base = next(
            r for r in study_runs.load(ROOT / "results/known_miscalibration_selection.json")
            if (r["logit_scale"], r["setting"], r["method"]) == (4.0, "demo", "base")
        )  # fmt: skip
        rows = [self.run(4.0, "demo", 0, "heldout", VARIANT, None, variant_overrides(lr))
                for lr in UPPER_LRS]  # fmt: skip
        best = min(rows, key=lambda r: r["conf_ece"] + (r["accuracy"] <= 0.8 * base["accuracy"]))
        print(f"selection (held-out, k = 4): upper LR {best['upper_lr']} "
              f"(conf-ECE {best['conf_ece']:.4f}, base {base['conf_ece']:.4f})")  # fmt: skip
        return float(best["upper_lr"])

    def main(self, lr: float, seeds=(0,)) -> None:
        for seed in seeds:
            for k in KS:
                self.run(k, "demo", seed, "test", VARIANT, None, variant_overrides(lr))
                if seed == 0:
                    for method in ("base", "ts"):
                        if k in (8.0, 4.0, 1.0) and not (method == "base" and k == 4.0):
                            self.run(k, "demo", 0, "test", method, None, {"method": method})
            if seed == 0:
                self.run(4.0, "demo", 0, "test", "paper", "per_step", PAPER)

    def budget(self, lr: float) -> None:
        """The chosen LR over 48 steps; the grid's bottom (whose 12 steps cannot travel ln 4)
        over 48; and 3x the grid's top, so the upper LR spans 10x above the bottom."""
        for upper, steps in ((lr, LONG), (3 * max(UPPER_LRS), 12), (min(UPPER_LRS), LONG)):
            self.run(4.0, "demo", 0, "heldout", VARIANT, None, variant_overrides(upper, steps))

    def ablation(self, lr: float) -> None:
        paper = {**PAPER, "method.module.surrogate.schedule": "amortized"}
        for label, switch in ABLATION.items():
            self.run(4.0, "demo", 0, "test", "paper", label, {**paper, **switch})
        vector = {**variant_overrides(lr), "method.head.kind": "vector"}
        self.run(4.0, "demo", 0, "test", VARIANT, "vector_head", vector)

    def leave_one_out(self, lr: float) -> None:
        for label, switch in LEAVE_ONE_OUT.items():
            self.run(4.0, "demo", 0, "test", VARIANT, label, {**variant_overrides(lr), **switch})

    def in_domain(self, lr: float) -> None:
        self.run(4.0, "demo_id", 0, "test", VARIANT, None, variant_overrides(lr))


# ----- rendering -----


def _ms(values: list[float]) -> str:
    return study_runs.mean_std(values) if values else "–"


def _committed() -> list[dict]:
    return study_runs.load(ROOT / "results/known_miscalibration.json")


def _row(name, k, setting, rows, base_ece=None) -> str:
    ece = [r["conf_ece"] for r in rows]
    temps = [r["effective_temperature"] for r in rows if r.get("effective_temperature")]
    ratio = f"{statistics.fmean(ece) / base_ece:.2f}" if base_ece and ece else "–"
    accuracy = _ms([r["accuracy"] for r in rows])
    where = study_runs.SETTINGS.get(setting, setting)
    return (f"| {k:g} | {where} | {name} | {len(rows)} | {accuracy} | {_ms(ece)} | {ratio} | "
            f"{_ms(temps)} |")  # fmt: skip


def render(results: Path, table: Path) -> None:
    records = study_runs.load(results)
    committed = _committed()
    lines = ["## Test split, OOD (`setting=demo`) and in domain (`demo_id`)", "",
             "| k | setting | method | seeds | accuracy | conf-ECE | × base | T_eff |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    cells = sorted({(r["logit_scale"], r["setting"]) for r in records if r["split"] == "test"},
                   key=lambda c: (c[1], c[0]))  # fmt: skip
    for k, setting in cells:

        def mine(variant, label=None, k=k, setting=setting):
            return [r for r in records if (r["logit_scale"], r["setting"], r["split"],
                    r["variant"], r["label"]) == (k, setting, "test", variant, label)]  # fmt: skip

        def old(method, schedule=None, k=k, setting=setting):
            return [r for r in committed if (r["logit_scale"], r["setting"], r["method"],
                    r["schedule"], r["label"]) == (k, setting, method, schedule, None)]  # fmt: skip

        base = mine("base") or old("base")
        base_ece = base[0]["conf_ece"] if base else None
        rows = [("base", base), ("ts (fitted on the held-out split)", mine("ts") or old("ts")),
                ("reg (committed study)", old("reg")),
                ("calm, paper form per_step (committed study)", old("calm", "per_step")),
                ("calm, paper form per_step (re-run here)", mine("paper", "per_step")),
                (f"{VARIANT}", mine(VARIANT))]  # fmt: skip
        rows += [(f"ablation: paper form + {label}", mine("paper", label)) for label in ABLATION]
        rows.append((f"ablation: {VARIANT} with the vector head", mine(VARIANT, "vector_head")))
        rows += [(f"{VARIANT} {label.replace('_', ' ')}", mine(VARIANT, label))
                 for label in LEAVE_ONE_OUT]  # fmt: skip
        lines += [_row(name, k, setting, rs, base_ece) for name, rs in rows if rs]
    lines += ["", "## Budget: T_eff at k = 4 (held-out split, seed 0; the head does not depend on "
              "the split scored)", "",
              "| variant | head | upper LR | outer steps | held-out accuracy | held-out conf-ECE "
              "| T_eff |", "|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in sorted(_budget_rows(records), key=lambda r: (r["variant"], r["outer_steps"],
                    r["upper_lr"])):  # fmt: skip
        t = r["effective_temperature"]
        lines.append(f"| {r['variant']} | {r['head']} | {r['upper_lr']} | {r['outer_steps']} | "
                     f"{r['accuracy']:.4f} | {r['conf_ece']:.4f} | "
                     f"{'–' if t is None else f'{t:.3f}'} |")  # fmt: skip
    boots = bootstraps(records)
    if boots:
        lines += [
            "",
            "## Paired bootstrap over test questions (b − a, conf-ECE)",
            "",
            "| a | b | k | b − a | s.e. | 95 % interval |",
            "|---|---|---|---|---|---|",
        ]
        for b in boots:
            lo, hi = b["ci95"]
            lines.append(f"| {b['a_name']} | {b['b_name']} | {b['k']:g} | {b['difference']:+.4f} "
                         f"| {b['standard_error']:.4f} | [{lo:+.4f}, {hi:+.4f}] |")  # fmt: skip
        study_runs.save(results.with_name(results.stem + "_bootstrap.json"), boots)
    table.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    figure(records, table.with_suffix(".png"))


def _budget_rows(records: list[dict]) -> list[dict]:
    """The variant's held-out runs at k = 4, and the paper form's scalar-head selection runs
    (committed; T_eff = 1 / d at the end, the head being scalar)."""
    rows = [r for r in records if r["split"] == "heldout" and r["logit_scale"] == 4.0]
    selection = study_runs.load(ROOT / "results/known_miscalibration_selection.json")
    for r in selection:
        o = r["overrides"]
        if (r["logit_scale"], r["setting"], r["method"]) != (4.0, "demo", "calm"):
            continue
        if o.get("method.head.kind") != "scalar":
            continue
        d = (r.get("calm_steps") or {}).get("d_mean_last")
        rows.append({"variant": "paper", "head": "scalar", "upper_lr": o["method.module.upper_lr"],
                     "outer_steps": 12, "accuracy": r["accuracy"], "conf_ece": r["conf_ece"],
                     "effective_temperature": (1 / d) if d and d > 0 else None})  # fmt: skip
    return rows


def bootstraps(records: list[dict]) -> list[dict]:
    """Paired bootstraps on the test split, where both run folders exist: the variant's every
    seed against base / TS (no randomness: their seed 0 stands for all) and against the paper
    form's re-run (seed 0)."""
    from calm_lightning.runtime.run_record import is_run_dir

    def find(k, variant, label, seed):
        for r in records:
            wanted = (r["logit_scale"], r["setting"], r["split"], r["variant"], r["label"],
                      r["seed"]) == (k, "demo", "test", variant, label, seed)  # fmt: skip
            if wanted and r.get("run_dir") and is_run_dir(ROOT / r["run_dir"]):
                return r
        return None

    pairs = [(4.0, "ts", None), (4.0, "paper", "per_step"), (1.0, "base", None),
             (8.0, "ts", None)]  # fmt: skip
    out = []
    for k, variant, label in pairs:
        ra = find(k, variant, label, 0)
        for seed in (0, 1, 2) if variant != "paper" else (0,):
            rb = find(k, VARIANT, None, seed)
            if ra is None or rb is None:
                continue
            result = paired_bootstrap.compare(*paired_bootstrap.paired(
                paired_bootstrap.predictions(ROOT / ra["run_dir"]),
                paired_bootstrap.predictions(ROOT / rb["run_dir"])))  # fmt: skip
            out.append({"k": k, "a_name": " ".join(x for x in (variant, label) if x),
                        "b_name": f"{VARIANT} seed {seed}", **result})  # fmt: skip
    return out


def figure(records: list[dict], path: Path) -> None:
    """T_eff against upper LR (k = 4) and against k, paper form and variant side by side."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9.0, 3.4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 2, 1)
    budget = _budget_rows(records)
    for variant, marker, colour in (("paper", "o", "C2"), (VARIANT, "s", "C3")):
        for steps, style in ((12, "-"), (LONG, ":")):
            pts = sorted((r["upper_lr"], r["effective_temperature"]) for r in budget
                         if r["variant"] == variant and r["outer_steps"] == steps
                         and r["effective_temperature"])  # fmt: skip
            if pts:
                x, y = zip(*pts, strict=True)
                ax.plot(x, y, style, marker=marker, color=colour,
                        label=f"{'paper form (scalar)' if variant == 'paper' else variant}, "
                              f"{steps} steps")  # fmt: skip
    for r in budget:  # d crossed 0: no temperature (uniform outputs)
        if r["effective_temperature"] is None:
            ax.annotate(f"{r['variant']} at {r['upper_lr']}: d < 0", (r["upper_lr"], 1.6),
                        fontsize=6, ha="center")  # fmt: skip
    ax.axhline(4.0, linestyle="--", color="grey", linewidth=0.8, label="known (T = k = 4)")
    ax.set_xscale("log")
    ax.set_xlabel("upper LR", fontsize=8)
    ax.set_ylabel("T_eff", fontsize=8)
    ax.set_title("k = 4: where the head stops vs its budget", fontsize=9)
    ax.legend(fontsize=6)
    ax = fig.add_subplot(1, 2, 2)
    committed = _committed()
    series = [
        ("paper form per_step (study)", "o", "C2",
         [r for r in committed if r["setting"] == "demo" and r["method"] == "calm"
          and r["schedule"] == "per_step" and r["label"] is None]),
        ("ts (OOD)", "^", "C0", [r for r in records + committed if r["setting"] == "demo"
                                 and (r.get("variant") or r.get("method")) == "ts"
                                 and r.get("split", "test") == "test"]),
        (VARIANT, "s", "C3", [r for r in records if r["setting"] == "demo"
                              and r["variant"] == VARIANT and r["label"] is None
                              and r["split"] == "test"]),
    ]  # fmt: skip
    ks = sorted({r["logit_scale"] for _, _, _, rows in series for r in rows})
    for name, marker, colour, rows in series:
        pts = []
        for k in ks:
            t = [r["effective_temperature"] for r in rows if r["logit_scale"] == k
                 and r["effective_temperature"]]  # fmt: skip
            if t:
                pts.append((k, statistics.fmean(t), statistics.stdev(t) if len(t) > 1 else 0))
        if pts:
            x, y, e = zip(*pts, strict=True)
            ax.errorbar(x, y, yerr=e, marker=marker, color=colour, capsize=3, label=name)
    ax.plot(ks, ks, "--", color="grey", linewidth=0.8, label="known (T = k)")
    ax.set_xlabel("k (logits x k)", fontsize=8)
    ax.set_xticks(ks)
    ax.set_title("tracking: T_eff against k (test split, OOD)", fontsize=9)
    ax.legend(fontsize=6)
    fig.suptitle("SmolLM2-135M-Instruct made k x over-confident: CALM's head", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=list(STAGES))
    parser.add_argument("--results", default="results/calm_variant.json")
    parser.add_argument("--outputs", default="outputs/calm_variant")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--model", default="smollm2", help="tiny: a smoke run in seconds")
    args = parser.parse_args()
    results = ROOT / args.results
    table = results.with_suffix(".md")
    study_runs.EXTRA.update({"model": args.model})
    if not args.render_only:
        runner = Study(results, ROOT / args.outputs)
        lr = runner.select()
        if "main" in args.stages:
            runner.main(lr)
        if "budget" in args.stages:
            runner.budget(lr)
        if "ablation" in args.stages:
            runner.ablation(lr)
        if "in_domain" in args.stages:
            runner.in_domain(lr)
        if "seeds" in args.stages:
            runner.main(lr, seeds=(1, 2))
        if "leave_one_out" in args.stages:
            runner.leave_one_out(lr)
    render(results, table)


if __name__ == "__main__":
    main()
