"""The known-miscalibration study: the embedded aligned model made k times over-confident.

`model.logit_scale=k` multiplies every logit of SmolLM2-135M-Instruct by k, so temperature k
undoes exactly what was added. For each cell (k, setting) this script

1. selects hyper-parameters on the held-out MCQA split (never the test split) for `reg` and
   `calm` by the paper's rule (lowest conf-ECE among runs keeping >= 0.8 x the held-out base
   accuracy), CALM's grid run with the cheap amortized schedule;
2. runs base, ts, reg, calm (per_step and amortized, T = 20) and calm with the head frozen
   (upper LR 0) on the test split, for every seed, each run a separate
   `python -m calm_lightning.run` process;
3. appends one record per run to the results file (`--results`, default
   `results/known_miscalibration.json`; selection runs go to `..._selection.json`) and renders
   the table (`--table`) and, for k = 4 OOD, the reliability diagrams of base / ts / reg / calm.

Runs already in the results file are skipped, so an interrupted study continues where it
stopped. Everything runs the demo budgets (12 outer steps of batch 4 for every training
method, the same for reg and calm). About 1.5 h on 2 CPU cores for k = 4 OOD with 3 seeds.

    python studies/known_miscalibration.py                          # the committed study
    python studies/known_miscalibration.py --cells 4:demo --seeds 0 --methods calm_per_step
        --results /tmp/check.json     # re-run one cell (k = 4 OOD, seed 0, CALM per_step)
    python studies/known_miscalibration.py --render-only            # table + figure only
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from calm_lightning.runtime.run_record import is_run_dir, read_run

if __package__:  # python -m studies.known_miscalibration, or imported from the package
    from . import study_runs
else:  # python studies/known_miscalibration.py: Python puts this folder first on the import path
    import study_runs

ROOT = study_runs.ROOT
SETTINGS = study_runs.SETTINGS
T = 20  # inner steps of the per_step estimator (paper: 20)
# Held-out selection grids. reg: the paper's LR grid and entropy weights from its grid up to
# 1 (a fair chance to flatten a 4x over-confident model). calm: head variants x upper LR; the
# demo's lower LR 1e-4 (1e-3 cost 7.5 accuracy points in the demo's own selection).
REG_GRID = [
    {"method.module.lr": lr, "method.module.alpha_reg": a}
    for lr in (1e-4, 1e-3)
    for a in (1e-5, 0.1, 1.0)
]
CALM_GRID = [
    {"method.head.kind": "vector", "method.head.center": "none", "method.module.upper_lr": 1e-2},
    *(
        {
            "method.head.kind": "vector",
            "method.head.center": "logsumexp",
            "method.module.upper_lr": lr,
        }
        for lr in (1e-2, 5e-2, 1e-1)
    ),  # fmt: skip
    # The scalar head's best held-out value sat at the grid's edge (1e-1), so the grid went on
    # to 2e-1, where d crossed 0 (uniform outputs, accuracy 12 %): larger LRs were not run.
    *({"method.head.kind": "scalar", "method.module.upper_lr": lr} for lr in (5e-2, 1e-1, 2e-1)),
]
METHODS = ("base", "ts", "reg", "calm_per_step", "calm_amortized", "calm_frozen_head")
GRID_LIMIT: list[int | None] = [None]  # --grid-limit: the first N entries of each grid


def method_overrides(method: str, chosen: dict) -> dict:
    if method in ("base", "ts"):
        return {"method": method}
    if method == "reg":
        return {"method": "reg", **chosen["reg"]}
    calm = {"method": "calm", "method.module.inner_steps": T, **chosen["calm"]}
    if method == "calm_per_step":
        return {**calm, "method.module.surrogate.schedule": "per_step"}
    calm["method.module.surrogate.schedule"] = "amortized"
    if method == "calm_frozen_head":
        calm["method.module.upper_lr"] = 0.0
    return calm


def key(record: dict) -> tuple:
    return tuple(
        record.get(k) for k in ("logit_scale", "setting", "method", "schedule", "seed", "label")
    )


def select(k: float, setting: str, outputs: Path, path: Path) -> dict:
    """Run (or read) the held-out grids of reg and calm; return the chosen overrides."""
    records = study_runs.load(path)
    done = {key(r) for r in records}

    def grid_run(method: str, label: str, overrides: dict) -> None:
        cell = {"logit_scale": k, "setting": setting, "method": method, "schedule": None,
                "seed": 0, "label": label, "overrides": overrides}  # fmt: skip
        if key(cell) in done:
            return
        run_dir = outputs / "selection" / f"k{k:g}_{setting}" / label
        payload = study_runs.run(
            {**study_runs.miscalibration_overrides(k, setting, 0, "heldout"), **overrides}, run_dir
        )
        records.append(study_runs.record_of(cell, payload, run_dir, None))
        study_runs.save(path, records)

    grid_run("base", "base", {"method": "base"})
    limit = GRID_LIMIT[0]
    for i, overrides in enumerate(REG_GRID[:limit]):
        grid_run("reg", f"reg_{i}", {"method": "reg", **overrides})
    for i, overrides in enumerate(CALM_GRID[:limit]):
        calm = {"method": "calm", "method.module.inner_steps": T,
                "method.module.surrogate.schedule": "amortized", **overrides}  # fmt: skip
        grid_run("calm", f"calm_{i}", calm)
    mine = [r for r in records if r["logit_scale"] == k and r["setting"] == setting]
    base_acc = next(r["accuracy"] for r in mine if r["method"] == "base")
    chosen = {}
    for method, grid in (("reg", REG_GRID), ("calm", CALM_GRID)):
        rows = [r for r in mine if r["method"] == method]
        # The paper's rule: conf-ECE, + 1 when accuracy falls to <= 0.8 x base.
        best = min(rows, key=lambda r: r["conf_ece"] + (r["accuracy"] <= 0.8 * base_acc))
        chosen[method] = {
            k_: v for k_, v in best["overrides"].items() if k_ in grid[0] or k_ in grid[-1]
        }
        print(f"k={k:g} {setting}: {method} chose {chosen[method]} ({best['label']})")
    return chosen


def study(args) -> None:
    outputs = ROOT / args.outputs
    results_path = ROOT / args.results
    selection_path = results_path.with_name(results_path.stem + "_selection.json")

    tokenizer, test_records = study_runs.tokenizer_and_test()
    for cell in args.cells:
        k_text, setting = cell.split(":")
        k = float(k_text)
        chosen = select(k, setting, outputs, selection_path)
        # A run counts as done only with the overrides the current selection gives; records
        # made under an earlier choice are dropped from the results file.
        records = [
            r for r in study_runs.load(results_path)
            if (r["logit_scale"], r["setting"]) != (k, setting)
            or r["overrides"] == method_overrides(_method_key(r), chosen)
        ]  # fmt: skip
        done = {(key(r), json.dumps(r["overrides"], sort_keys=True)) for r in records}
        for seed in args.seeds:
            for method in args.methods:
                if method == "base" and any(
                    (r["logit_scale"], r["setting"], r["method"]) == (k, setting, "base")
                    for r in records
                ):
                    continue  # no randomness: one run stands for every seed
                schedule = method.split("_", 1)[1] if method.startswith("calm_") else None
                if method == "calm_frozen_head":
                    schedule = "amortized"
                name = "calm" if method.startswith("calm") else method
                label = "frozen_head" if method == "calm_frozen_head" else None
                meta = {"logit_scale": k, "setting": setting, "method": name,
                        "schedule": schedule, "seed": seed, "label": label}  # fmt: skip
                meta["overrides"] = method_overrides(method, chosen)
                if (key(meta), json.dumps(meta["overrides"], sort_keys=True)) in done:
                    continue
                overrides = {
                    **study_runs.miscalibration_overrides(k, setting, seed, "test"),
                    **meta["overrides"],
                }
                tag = "_".join(f"{v}" for k_, v in meta["overrides"].items() if k_ != "method")
                run_dir = outputs / f"k{k:g}_{setting}" / f"{method}_s{seed}_{tag}".rstrip("_")
                payload = study_runs.run(overrides, run_dir)
                temperature = study_runs.effective_temperature(
                    run_dir, payload, tokenizer, test_records
                )
                records.append(study_runs.record_of(meta, payload, run_dir, temperature))
                study_runs.save(results_path, records)
    render(results_path, ROOT / args.table, outputs)


def _method_key(record: dict) -> str:
    """The METHODS entry a results record was made by."""
    if record["method"] != "calm":
        return record["method"]
    return "calm_frozen_head" if record["label"] == "frozen_head" else f"calm_{record['schedule']}"


ROW_ORDER = [
    ("base", None, None),
    ("ts", None, None),
    ("reg", None, None),
    ("calm", "per_step", None),
    ("calm", "amortized", None),
    ("calm", "amortized", "frozen_head"),
]


def render(results_path: Path, table_path: Path, outputs: Path) -> None:
    """The markdown table (mean ± std over seeds) and the k = 4 OOD reliability figure."""
    records = study_runs.load(results_path)
    lines = [
        "| k | setting | method | seeds | accuracy | mean conf. | conf-ECE | cw-ECE | T_eff |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = sorted({(r["logit_scale"], r["setting"]) for r in records}, key=lambda c: (c[1], c[0]))
    for k, setting in cells:
        for method, schedule, label in ROW_ORDER:
            rows = [
                r for r in records
                if (r["logit_scale"], r["setting"], r["method"], r["schedule"], r["label"])
                == (k, setting, method, schedule, label)
            ]  # fmt: skip
            if not rows:
                continue
            name = method + (f" {schedule}" if schedule else "") + (f" ({label})" if label else "")
            temps = [r["effective_temperature"] for r in rows if r["effective_temperature"]]
            cells_ = [
                study_runs.mean_std([r["accuracy"] for r in rows]),
                study_runs.mean_std([r["mean_confidence"] for r in rows]),
                study_runs.mean_std([r["conf_ece"] for r in rows]),
                study_runs.mean_std([r["cw_ece"] for r in rows]),
                study_runs.mean_std(temps) if temps else "–",
            ]
            lines.append(
                f"| {k:g} | {SETTINGS.get(setting, setting)} | {name} | {len(rows)} | "
                + " | ".join(cells_)
                + " |"
            )
    table_path.parent.mkdir(parents=True, exist_ok=True)
    table_path.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    _figure(records, table_path.with_suffix(".png"))
    _by_k_figure(records, table_path.with_name(table_path.stem + "_by_k.png"))


def _figure(records: list[dict], path: Path) -> None:
    """Confidence reliability diagrams of base / ts / reg / calm (seed 0) at k = 4, OOD."""
    import numpy as np
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from calm_lightning.metrics.calibration import reliability_bins

    wanted = [("base", None), ("ts", None), ("reg", None), ("calm", "per_step")]
    panels = []
    for method, schedule in wanted:
        match = [
            r for r in records
            if r["logit_scale"] == 4 and r["setting"] == "demo" and r["method"] == method
            and r["schedule"] == schedule and r["label"] is None and r["run_dir"]
        ]  # fmt: skip
        if match:
            panels.append((method + (f" {schedule}" if schedule else ""), min(match, key=_seed)))
    if not panels:
        return
    missing = [r["run_dir"] for _, r in panels if not is_run_dir(ROOT / r["run_dir"])]
    if missing:  # run folders are not committed; the figure is redrawn where they exist
        print(f"{path.name} not redrawn (the existing file stays): no run folder {missing[0]}")
        return
    fig = Figure(figsize=(3.2 * len(panels), 3.2))
    FigureCanvasAgg(fig)
    for index, (name, record) in enumerate(panels, start=1):
        rows = read_run(ROOT / record["run_dir"]).predictions()
        probs = np.array([r["probs"] for r in rows])
        labels = np.array([r["label"] for r in rows])
        bins = reliability_bins(probs.max(1), probs.argmax(1) == labels, 10)
        ax = fig.add_subplot(1, len(panels), index)
        full = bins.counts > 0
        ax.bar(bins.edges[:-1][full], bins.accuracy[full], width=0.1, align="edge",
               edgecolor="black", linewidth=0.5, label="accuracy")  # fmt: skip
        ax.plot([0, 1], [0, 1], "--", color="grey", linewidth=0.8)
        ax.set_title(f"{name}: conf-ECE {record['conf_ece']:.3f}", fontsize=9)
        ax.set_xlabel("confidence", fontsize=8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    fig.suptitle("SmolLM2-135M-Instruct, logits x 4, OOD (demo), seed 0", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


BY_K = [  # (method, schedule, label, legend, marker and colour) of the across-k figure
    ("ts", None, None, "ts", "s", "C0"),
    ("reg", None, None, "reg", "v", "C1"),
    ("calm", "per_step", None, "calm per_step", "o", "C2"),
    ("calm", "amortized", None, "calm amortized", "D", "C3"),
    ("calm", "amortized", "frozen_head", "calm frozen head", "x", "C4"),
]


def _by_k_figure(records: list[dict], path: Path) -> None:
    """Across k, per setting: each method's effective temperature against the known one (T = k)
    and its conf-ECE as a fraction of the base's, mean ± sample std over seeds. Drawn only
    when some setting has more than one k."""
    import statistics

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    settings = [s for s in SETTINGS if len({r["logit_scale"] for r in records
                                            if r["setting"] == s}) > 1]  # fmt: skip
    if not settings:
        return
    fig = Figure(figsize=(8.0, 3.2 * len(settings)))
    FigureCanvasAgg(fig)
    for row, setting in enumerate(settings):
        mine = [r for r in records if r["setting"] == setting]
        ks = sorted({r["logit_scale"] for r in mine})
        base = {r["logit_scale"]: r["conf_ece"] for r in mine if r["method"] == "base"}
        ax_t = fig.add_subplot(len(settings), 2, 2 * row + 1)
        ax_e = fig.add_subplot(len(settings), 2, 2 * row + 2)
        ax_t.plot(ks, ks, "--", color="grey", linewidth=0.8, label="known (T = k)")
        ax_e.axhline(1.0, linestyle="--", color="grey", linewidth=0.8, label="base")
        for method, schedule, label, legend, marker, colour in BY_K:
            temps, eces = [], []
            for k in ks:
                rows = [r for r in mine if (r["logit_scale"], r["method"], r["schedule"],
                        r["label"]) == (k, method, schedule, label)]  # fmt: skip
                t = [r["effective_temperature"] for r in rows if r["effective_temperature"]]
                if t and label is None:
                    temps.append((k, statistics.fmean(t), _sd(t)))
                e = [r["conf_ece"] / base[k] for r in rows if k in base]
                if e:
                    eces.append((k, statistics.fmean(e), _sd(e)))
            for ax, points in ((ax_t, temps), (ax_e, eces)):
                if points:
                    x, y, err = zip(*points, strict=True)
                    ax.errorbar(
                        x, y, yerr=err, marker=marker, color=colour, capsize=3, label=legend
                    )
        name = SETTINGS[setting]
        ax_t.set_title(f"{name}: effective temperature on the options", fontsize=9)
        ax_e.set_title(f"{name}: conf-ECE / base's conf-ECE", fontsize=9)
        for ax in (ax_t, ax_e):
            ax.set_xlabel("k (logits x k)", fontsize=8)
            ax.set_xticks(ks)
            ax.legend(fontsize=7)
    fig.suptitle("SmolLM2-135M-Instruct made k x over-confident (test split)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _sd(values: list[float]) -> float:
    import statistics

    return statistics.stdev(values) if len(values) > 1 else 0.0


def _seed(record: dict) -> int:
    return record["seed"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", nargs="+", default=["4:demo"], help="k:setting pairs")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--results", default="results/known_miscalibration.json")
    parser.add_argument("--table", help="markdown table (default: --results with .md)")
    parser.add_argument("--outputs", default="outputs/known_miscalibration")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--model", default="smollm2", help="tiny: a smoke run in seconds")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for every run")
    parser.add_argument("--grid-limit", type=int, default=None, help="first N of each grid")
    args = parser.parse_args()
    # A check run (--results /tmp/check.json) must not overwrite the committed table/figure.
    args.table = args.table or str(Path(args.results).with_suffix(".md"))
    study_runs.EXTRA.update({"model": args.model}, **dict(o.split("=", 1) for o in args.extra))
    GRID_LIMIT[0] = args.grid_limit
    if args.render_only:
        render(ROOT / args.results, ROOT / args.table, ROOT / args.outputs)
        return
    study(args)


if __name__ == "__main__":
    main()
