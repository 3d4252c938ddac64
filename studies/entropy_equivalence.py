"""At the paper's own learning rates, is CALM entropy regularisation with alpha = 1 / lambda?

With the head (almost) frozen, CALM's adapter update is grad_theta f + lambda grad_theta q =
lambda x grad [CE(train) - (1 / lambda) H(held-out)] (the surrogate is a stopped gradient), and
AdamW ignores a constant positive factor up to its eps: for a constant lambda, paper-form CALM
is `reg` with alpha_reg = 1 / lambda and the entropy on the held-out inputs
(tests/test_entropy_equivalence.py checks one step). This study asks whether that holds over a
run, and whether the paper's Regularization grid (alpha 1e-5) is a fair stand-in for it.

The cell: the embedded SmolLM2-135M-Instruct, `setting=demo` (OOD: train on demo instructions,
held-out instructions for the entropy, test on the 320 demo MCQA questions), k = 1
(`model.logit_scale`; optionally k = 2), 48 outer steps of batch 4, the warmup-cosine schedule
of calm.yaml (warmup 0.4) for every arm, shared seeds and so shared data order. Each run is its
own `python -m calm_lightning.run` process. Stages, resumable (a finished run's record is
skipped):

1. `select`: CALM's lower LR on the held-out MCQA split (never the test split) from LOWER_LRS
   by the paper's rule (lowest conf-ECE among runs keeping > 0.8 x the held-out base accuracy),
   calm_vector at seed 0; every arm then uses it;
2. references on the test split: base and TS-OOD (no randomness: seed 0 stands for all);
3. the arms (ARMS), per seed; `reg_lambda` takes alpha = 1 / lambda-bar, the mean lambda that
   the same seed's `calm_frozen` run logged (a prediction, never fitted on test).

Results: `results/entropy_equivalence.json` = {"hypotheses" (written before any run),
"protocol", "selection", "rows", "comparisons" (paired bootstraps, 2,000 resamples),
"adapter_cosine" {seed: cosine of calm_frozen's and reg_lambda's weight deltas, k = 1},
"adapter_pairs", "outcomes"}; `--render-only` recomputes comparisons where the run folders
exist and the outcomes from whatever rows exist, and writes `results/entropy_equivalence.md`
and `.png`.

    python studies/entropy_equivalence.py --hypotheses-only   # the prediction, before any run
    python studies/entropy_equivalence.py --dry-run           # the runs and their overrides
    python studies/entropy_equivalence.py                     # k = 1, 3 seeds (~2.3 h, 2 cores)
    python studies/entropy_equivalence.py --k 2               # the optional k = 2 cell
    python studies/entropy_equivalence.py --render-only
    python studies/entropy_equivalence.py --smoke             # tiny model, 2 steps (a minute)
"""

from __future__ import annotations

import argparse
import csv
import datetime
import hashlib
import json
import math
import shutil
import statistics
import time
from pathlib import Path

if __package__:  # python -m studies.entropy_equivalence, or imported from the package
    from . import paired_bootstrap, study_runs
else:  # python studies/entropy_equivalence.py: Python puts this folder first on the import path
    import paired_bootstrap
    import study_runs

ROOT = study_runs.ROOT
RESULTS = ROOT / "results" / "entropy_equivalence.json"
SETTING = "demo"  # OOD: the one cell where TS fails across domains on this model (k = 1)
STEPS = 48  # outer steps (= training batches) of every training arm
SMOKE_STEPS = 2
SEEDS = (0, 1, 2)
LOWER_LRS = (1e-3, 1e-2)  # the paper's lower-LR grid (Table 6 picks 1e-3 or 1e-2)
UPPER_LR = 1e-5  # inside the paper's 1e-4 ... 1e-7 grid: the head barely moves
REG_PAPER_ALPHA = 1e-5  # the paper's Regularization grid: 1e-5, 1e-6
WARMUP = 0.4  # calm.yaml's warmup share, given to reg too (its own default is 0.2)
# Paper-form CALM (lower value function, one lambda, AdamW head, centre none). The amortized
# surrogate (m = 1, ~2 reg steps per outer step) instead of per_step's T = 20 (~15): the
# adapters' direction depends on theta~ only through lambda, and 48 per_step steps would cost
# ~40 min a run.
CALM = {
    "method": "calm",
    "method.head.center": "none",
    "method.module.surrogate.schedule": "amortized",
    "method.module.upper_lr": UPPER_LR,
}
ARMS = ("calm_vector", "calm_scalar", "calm_frozen", "reg_lambda", "reg_paper", "sft")
CALM_ARMS = ("calm_vector", "calm_scalar", "calm_frozen")
TRAVEL_LIMIT = 1e-3  # H2: the head's largest entry move
COSINE_LIMIT = 0.9  # H1: calm_frozen's and reg_lambda's weight deltas
ACCURACY_FLOOR = 0.8  # H3: x base accuracy (the paper's selection rule)
METRICS = ("conf_ece", "nll", "accuracy")
# Paired bootstraps (b - a), per k and seed; a reference arm (base, ts) is seed 0's run.
PAIRS = (
    ("calm_frozen", "reg_lambda"),  # H1
    ("calm_vector", "reg_lambda"),  # H1
    ("calm_frozen", "calm_vector"),  # H1
    ("calm_vector", "calm_scalar"),  # H2
    ("ts", "calm_vector"),  # H3
    ("sft", "reg_paper"),  # H4
    ("sft", "calm_vector"),  # context: CALM against plain LoRA fine-tuning
    ("sft", "reg_lambda"),  # context: the entropy term's own effect
)
# Weight-delta comparisons (k, seed): the first is H1's adapter cosine; sft gives the scale of
# agreement between two runs that share only data, seed and LR.
ADAPTER_PAIRS = (
    ("calm_frozen", "reg_lambda"),
    ("calm_vector", "reg_lambda"),
    ("calm_frozen", "sft"),
    ("reg_lambda", "sft"),
)

HYPOTHESES = {
    "H1": {
        "statement": "`calm_frozen`, `calm_vector` and `reg_lambda` agree (every interval of "
        "conf-ECE, NLL, accuracy contains 0 in ≥ 2 of 3 seeds, and adapter cosine ≥ 0.9)",
        "test": "k = 1, test split. For each pair (calm_frozen, reg_lambda), (calm_vector, "
        "reg_lambda), (calm_frozen, calm_vector) and each of conf-ECE, NLL, accuracy, the paired "
        "bootstrap 95 % interval of the difference (2,000 resamples) contains 0 in >= 2 of the 3 "
        "seeds; and the cosine between calm_frozen's and reg_lambda's adapter weight deltas "
        "(sum over adapted matrices of (alpha / r) B A) is >= 0.9 in every seed. Falsified when "
        "either fails; inconclusive while a seed's rows are missing.",
    },
    "H2": {
        "statement": "`calm_vector` and `calm_scalar` agree and head travel ≤ 1e-3",
        "test": "k = 1, test split. The paired bootstrap intervals of conf-ECE, NLL and accuracy "
        "between calm_vector and calm_scalar contain 0 in >= 2 of 3 seeds, and both heads' travel "
        "(the largest |d - 1| or |l| over the head's entries at the end) is <= 1e-3 in every "
        "seed.",
    },
    "H3": {
        "statement": "`calm_vector` beats TS-OOD's conf-ECE outside the interval in ≥ 2 seeds "
        "at ≥ 0.8 × base accuracy",
        "test": "k = 1, test split. The paired bootstrap 95 % interval of conf-ECE(calm_vector) - "
        "conf-ECE(ts) lies entirely below 0, with calm_vector's accuracy >= 0.8 x the base "
        "row's, in >= 2 of the 3 seeds (ts and base: seed 0's run, which has no randomness).",
    },
    "H4": {
        "statement": "`reg_paper` is indistinguishable from plain LoRA fine-tuning",
        "test": "k = 1, test split. The paired bootstrap intervals of conf-ECE, NLL and accuracy "
        "between reg_paper (alpha 1e-5) and sft (alpha 0) contain 0 in >= 2 of the 3 seeds.",
    },
}
# Known before any run, written with the hypotheses: what "contains 0" cannot tell apart.
CAVEAT = (
    "Paired arms share seed, data order and LoRA initialisation, so their predictions can "
    "differ by far less than the split's noise (one run against another: s.e. ~0.013 conf-ECE "
    "on 320 questions) and still give an interval that excludes 0. The outcome names every "
    "failing interval's largest |b - a|, so a verdict carried by a negligible difference can "
    "be told from a real one; the verdict itself follows the rule as stated."
)
# Another logit scale (the optional k = 2): recorded in the results file, with the time,
# the first time a run of the study names that k, so it is on record before the cell's runs.
OTHER_K = (
    "The four hypotheses' tests, applied unchanged to this cell (its own lower-LR selection on "
    "the held-out split, its own base and TS-OOD rows, adapter cosine from its calm_frozen and "
    "reg_lambda runs). A secondary cell: the stated hypotheses are about k = 1."
)
PROTOCOL = (
    f"setting={SETTING} (OOD), model.logit_scale=k, {STEPS} outer steps of batch 4, one epoch, "
    f"warmup-cosine with warmup {WARMUP} for every arm, setting.max_length 192, seeds "
    f"{list(SEEDS)}; the lower LR chosen once per k on the held-out split from "
    f"{list(LOWER_LRS)} (calm_vector, seed 0, the paper's rule) and used by every arm. Arms: "
    f"calm_vector / calm_scalar (paper form, upper LR {UPPER_LR:g}, amortized surrogate), "
    "calm_frozen (upper LR 0), reg_lambda (alpha = 1 / the mean lambda of the same seed's "
    f"calm_frozen, entropy on the held-out batch), reg_paper (alpha {REG_PAPER_ALPHA:g}, entropy "
    "on the training batch), sft (alpha 0); references base and ts on the test split."
)


# ----- the runs -----


def protocol_overrides(k: float, seed: int, split: str, steps: int) -> dict:
    return {
        **study_runs.miscalibration_overrides(k, SETTING, seed, split),
        "trainer.limit_train_batches": steps,
        "trainer.max_epochs": 1,
    }


def arm_overrides(arm: str, lower_lr: float, alpha: float | None = None) -> dict:
    """What one arm changes on top of the protocol."""
    if arm in CALM_ARMS:
        calm = {**CALM, "method.module.lower_lr": lower_lr}
        if arm == "calm_scalar":
            return {**calm, "method.head.kind": "scalar"}
        calm["method.head.kind"] = "vector"
        if arm == "calm_frozen":
            calm["method.module.upper_lr"] = 0.0
        return calm
    reg = {"method": "reg", "method.module.lr": lower_lr, "method.module.warmup_ratio": WARMUP}
    if arm == "reg_lambda":
        return {**reg, "method.module.alpha_reg": alpha, "method.module.entropy_on": "heldout"}
    if arm == "reg_paper":
        return {**reg, "method.module.alpha_reg": REG_PAPER_ALPHA}
    if arm == "sft":
        return {**reg, "method.module.alpha_reg": 0.0}
    return {"method": arm}  # base, ts


def _digest(overrides: dict) -> str:
    return hashlib.sha1(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]


class Study:
    def __init__(self, results: Path, outputs: Path, steps: int, dry_run: bool = False) -> None:
        self.results, self.outputs, self.steps, self.dry_run = results, outputs, steps, dry_run
        self.doc = load(results)

    def save(self) -> None:
        if not self.dry_run:
            study_runs.save(self.results, self.doc)

    def _find(self, table: str, arm: str, k: float, seed: int, overrides: dict) -> dict | None:
        for row in self.doc[table]:
            if (row["arm"], row["k"], row["seed"], row["overrides"]) == (arm, k, seed, overrides):
                return row
        return None

    def run(self, table: str, arm: str, k: float, seed: int, split: str, overrides: dict):
        """One run, or its record when done; None in a dry run (printed instead)."""
        found = self._find(table, arm, k, seed, overrides)
        if self.dry_run:
            shown = " ".join(f"{key}={value}" for key, value in overrides.items())
            done = " (done)" if found else ""
            print(f"  {table:9} k={k:g} seed={seed} {arm:12} {split:7}{done} {shown}")
            return found
        if found is not None:
            return found
        name = f"{arm}_s{seed}_{_digest(overrides)}"
        run_dir = self.outputs / f"k{k:g}" / ("select" if table == "selection" else "") / name
        start = time.time()
        payload = study_runs.run(
            {**protocol_overrides(k, seed, split, self.steps), **overrides}, run_dir
        )
        row = row_of(arm, k, seed, split, overrides, payload, run_dir)
        row["seconds"] = round(time.time() - start, 1)
        # ~0.5 GB of checkpoints a training run; the adapters and head stay in calibration/
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
        self.doc[table] = [
            r for r in self.doc[table] if (r["arm"], r["k"], r["seed"]) != (arm, k, seed)
        ] + [row]
        self.save()
        return row

    def lower_lr(self, k: float) -> float | None:
        """CALM's lower LR for cell k by the paper's rule on the held-out split."""
        base = self.run("selection", "base", k, 0, "heldout", arm_overrides("base", 0.0))
        rows = [
            self.run(
                "selection",
                f"calm_vector_lr{lr:g}",
                k,
                0,
                "heldout",
                arm_overrides("calm_vector", lr),
            )
            for lr in LOWER_LRS
        ]
        if base is None or None in rows:
            return None
        best = min(
            rows, key=lambda r: r["conf_ece"] + (r["accuracy"] <= ACCURACY_FLOOR * base["accuracy"])
        )
        lr = float(best["overrides"]["method.module.lower_lr"])
        print(
            f"k={k:g}: lower LR {lr:g} (held-out conf-ECE {best['conf_ece']:.4f}, base "
            f"{base['conf_ece']:.4f})",
            flush=True,
        )
        return lr

    def cell(self, k: float, seeds, arms) -> None:
        if self.dry_run:
            shared = protocol_overrides(k, "SEED", "SPLIT", self.steps)
            print(f"k={k:g}, every run: " + " ".join(f"{a}={b}" for a, b in shared.items()))
        lr = self.lower_lr(k)
        if lr is None:  # a dry run before the selection has run
            lr = "SELECTED"
        if "calm_vector" in arms:  # H3's references
            for ref in ("base", "ts"):
                self.run("rows", ref, k, 0, "test", arm_overrides(ref, lr))
        wanted = list(arms)
        if "reg_lambda" in wanted and "calm_frozen" not in wanted:
            wanted.insert(wanted.index("reg_lambda"), "calm_frozen")  # its lambda-bar
        for seed in seeds:
            for arm in wanted:
                alpha = None
                if arm == "reg_lambda":
                    frozen = self._find(
                        "rows", "calm_frozen", k, seed, arm_overrides("calm_frozen", lr)
                    )
                    if frozen is None:
                        print(
                            f"  rows      k={k:g} seed={seed} reg_lambda   alpha = 1 / the "
                            "mean lambda of calm_frozen (this seed), once it has run"
                        )
                        continue
                    alpha = 1.0 / frozen["lambda_mean"]
                self.run("rows", arm, k, seed, "test", arm_overrides(arm, lr, alpha))
            if not self.dry_run:
                update_adapter_pairs(self.doc, k, seed)
                self.save()


def row_of(arm, k, seed, split, overrides, payload: dict, run_dir: Path) -> dict:
    metrics = payload["metrics"]
    row = {
        "arm": arm,
        "seed": seed,
        "k": k,
        "setting": SETTING,
        "split": split,
        "accuracy": metrics["accuracy"],
        "nll": metrics["nll"],
        "conf_ece": metrics["conf_ece"],
        "cw_ece": metrics.get("cw_ece"),
        "brier": metrics.get("brier"),
        "mean_confidence": metrics.get("mean_confidence"),
        "overrides": overrides,
        "run_dir": str(run_dir.relative_to(ROOT)) if run_dir.is_relative_to(ROOT) else str(run_dir),
        "timings": payload.get("timings"),
    }
    if "method.module.alpha_reg" in overrides:
        row["alpha"] = overrides["method.module.alpha_reg"]
    steps = payload.get("calm_steps")
    if steps:
        row["lambda_mean"] = steps["lambda_mean"]
        row["lambda_t"] = lambda_series(run_dir)
        row["head_travel"] = head_travel(run_dir)
    return row


def lambda_series(run_dir: Path) -> list[float]:
    """calm/lambda at every outer step, from the run's CSV log."""
    path = run_dir / "csv" / "metrics.csv"
    if not path.is_file():
        return []
    with path.open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("calm/lambda")]
    rows.sort(key=lambda r: float(r["calm/outer_step"]))
    return [float(r["calm/lambda"]) for r in rows]


def head_travel(run_dir: Path) -> float | None:
    """The largest move of any head entry from the identity (d = 1, l = 0)."""
    path = run_dir / "calibration" / "logit_adjustment.safetensors"
    if not path.is_file():
        return None
    from safetensors.torch import load_file

    head = load_file(str(path))
    return max(
        float((head["scale"].double() - 1).abs().max()), float(head["bias"].double().abs().max())
    )


# ----- adapter weight deltas -----


def lora_factors(run_dir: Path) -> dict | None:
    """Adapted matrix -> (A, B, scale) of a run's saved adapter; B starts at 0, so scale B A
    is the whole change the adapter made to that matrix."""
    folder = ROOT / run_dir / "calibration" / "adapter"
    if not (folder / "adapter_model.safetensors").is_file():
        return None
    from safetensors.torch import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    r = config["r"]
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    out = {}
    for name, a in tensors.items():
        if ".lora_A." in name:
            out[name.split(".lora_A.")[0]] = (
                a.double(),
                tensors[name.replace(".lora_A.", ".lora_B.")].double(),
                scale,
            )
    return out


def _inner(x: tuple, y: tuple) -> float:
    """<s_x B_x A_x, s_y B_y A_y>_F = s_x s_y trace((B_x^T B_y)(A_y A_x^T)): r x r products,
    the full matrices never formed."""
    (ax, bx, sx), (ay, by, sy) = x, y
    return sx * sy * float((bx.T @ by @ (ay @ ax.T)).trace())


def weight_delta_comparison(run_a: str, run_b: str) -> dict | None:
    """Cosine and ||dW_a - dW_b|| / ||dW_a|| over every adapted matrix."""
    fa, fb = lora_factors(Path(run_a)), lora_factors(Path(run_b))
    if fa is None or fb is None or fa.keys() != fb.keys():
        return None
    aa = sum(_inner(fa[m], fa[m]) for m in fa)
    bb = sum(_inner(fb[m], fb[m]) for m in fb)
    ab = sum(_inner(fa[m], fb[m]) for m in fa)
    return {
        "cosine": ab / math.sqrt(aa * bb),
        "relative_difference": math.sqrt(max(aa + bb - 2 * ab, 0.0) / aa),
        "norm_a": math.sqrt(aa),
        "norm_b": math.sqrt(bb),
    }


def update_adapter_pairs(doc: dict, k: float, seed: int) -> None:
    """Weight-delta comparisons of a seed whose run folders exist (kept once measured)."""
    rows = {r["arm"]: r for r in doc["rows"] if (r["k"], r["seed"]) == (k, seed)}
    for a, b in ADAPTER_PAIRS:
        if a not in rows or b not in rows:
            continue
        measured = weight_delta_comparison(rows[a]["run_dir"], rows[b]["run_dir"])
        if measured is None:
            continue
        doc["adapter_pairs"] = [
            p
            for p in doc["adapter_pairs"]
            if (p["k"], p["seed"], p["a"], p["b"]) != (k, seed, a, b)
        ]
        doc["adapter_pairs"].append({"k": k, "seed": seed, "a": a, "b": b, **measured})
        if (a, b) == ADAPTER_PAIRS[0] and k == 1.0:
            doc["adapter_cosine"][str(seed)] = measured["cosine"]


def _adapter_cosine(doc: dict, k: float, seed: int) -> float | None:
    """H1's adapter cosine of a seed at cell k (k = 1 keeps its own map, as the issue asks)."""
    if k == 1.0:
        return doc["adapter_cosine"].get(str(seed))
    return next(
        (
            p["cosine"]
            for p in doc["adapter_pairs"]
            if (p["k"], p["seed"], p["a"], p["b"]) == (k, seed, *ADAPTER_PAIRS[0])
        ),
        None,
    )


# ----- the results file -----


def new_document() -> dict:
    return {
        "hypotheses": {
            **HYPOTHESES,
            "caveat": CAVEAT,
            "stated": datetime.date.today().isoformat(),
        },
        "protocol": PROTOCOL,
        "selection": [],
        "rows": [],
        "comparisons": [],
        "adapter_cosine": {},
        "adapter_pairs": [],
        "outcomes": {},
        "other_k": {},  # {"2": {"stated", "rule", "outcomes"}}
    }


def state_other_k(doc: dict, ks) -> None:
    """Put the rule for each k other than 1 on record (once, with the time) before its runs."""
    for k in ks:
        if k != 1.0 and f"{k:g}" not in doc["other_k"]:
            stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="minutes")
            doc["other_k"][f"{k:g}"] = {"stated": stamp, "rule": OTHER_K, "outcomes": {}}


def all_outcomes(doc: dict) -> None:
    doc["outcomes"] = outcomes(doc)
    for key, cell in doc["other_k"].items():
        cell["outcomes"] = outcomes(doc, float(key))


def load(path: Path) -> dict:
    """The results document; a file written before the runs keeps its hypotheses as stated."""
    doc = new_document()
    if path.is_file():
        stored = json.loads(path.read_text())
        if "hypotheses" in stored and stored["hypotheses"].get("H1") != HYPOTHESES["H1"]:
            print(
                "note: the results file's hypotheses differ from the script's; the file's "
                "(stated before the runs) are kept"
            )
        doc.update(stored)
    return doc


# ----- comparisons and outcomes -----


def compute_comparisons(doc: dict) -> None:
    """Paired bootstraps of PAIRS where both run folders exist; stored ones are kept."""
    from calm_lightning.runtime.run_record import is_run_dir

    rows = doc["rows"]
    cells = sorted({(r["k"], r["seed"]) for r in rows if r["arm"] in ARMS})
    for k, seed in cells:
        for a, b in PAIRS:
            ra = _row(rows, a, k, 0 if a in ("base", "ts") else seed)
            rb = _row(rows, b, k, seed)
            if ra is None or rb is None:
                continue
            if not (is_run_dir(ROOT / ra["run_dir"]) and is_run_dir(ROOT / rb["run_dir"])):
                continue
            pa, pb, labels = paired_bootstrap.paired(
                paired_bootstrap.predictions(ROOT / ra["run_dir"]),
                paired_bootstrap.predictions(ROOT / rb["run_dir"]),
            )
            for metric in METRICS:
                c = paired_bootstrap.compare(pa, pb, labels, metric=metric, resamples=2000)
                entry = {
                    "k": k,
                    "seed": seed,
                    "a": a,
                    "b": b,
                    "metric": metric,
                    "value_a": c["a"],
                    "value_b": c["b"],
                    "difference": c["difference"],
                    "standard_error": c["standard_error"],
                    "ci95": c["ci95"],
                    "questions": c["questions"],
                }
                doc["comparisons"] = [x for x in doc["comparisons"] if _key(x) != _key(entry)]
                doc["comparisons"].append(entry)


def _key(c: dict) -> tuple:
    return c["k"], c["seed"], c["a"], c["b"], c["metric"]


def _row(rows: list[dict], arm: str, k: float, seed: int) -> dict | None:
    return next((r for r in rows if (r["arm"], r["k"], r["seed"]) == (arm, k, seed)), None)


def _comparison(doc: dict, a: str, b: str, metric: str, seed: int, k: float = 1.0):
    return next((c for c in doc["comparisons"] if _key(c) == (k, seed, a, b, metric)), None)


def _agreement(doc: dict, pairs, k: float = 1.0, seeds=SEEDS) -> tuple[str | None, str]:
    """'held' / 'falsified' when every (pair, metric) interval contains 0 in >= 2 of 3 seeds
    or not; None with the reason while intervals are missing. A failing interval is reported
    with its largest |b - a|, so a negligible but consistent difference shows as such."""
    absent_seeds, failing = set(), []
    for a, b in pairs:
        for metric in METRICS:
            found = [_comparison(doc, a, b, metric, seed, k) for seed in seeds]
            absent = [seed for seed, c in zip(seeds, found, strict=True) if c is None]
            present = [c for c in found if c is not None]
            zero = sum(c["ci95"][0] <= 0 <= c["ci95"][1] for c in present)
            if zero + len(absent) < 2:  # cannot reach 2 of 3 whatever the missing seeds give
                largest = max(abs(c["difference"]) for c in present)
                failing.append(
                    f"{a} vs {b} {metric}: 0 inside in {zero} of {len(seeds)} seeds "
                    f"(largest |b - a| {largest:.4g})"
                )
            elif zero < 2:
                absent_seeds.update(absent)
    if failing:
        return "falsified", "; ".join(failing)
    if absent_seeds:
        names = ", ".join(f"{a} vs {b}" for a, b in pairs)
        return None, f"no paired bootstrap yet for seeds {sorted(absent_seeds)} ({names})"
    return "held", "every interval contains 0 in >= 2 of 3 seeds"


def outcomes(doc: dict, k: float = 1.0) -> dict:
    """H1-H4 from whatever rows and comparisons exist at cell k (stated for k = 1; another k
    gets the same tests, stated before its runs: OTHER_K)."""
    rows = [r for r in doc["rows"] if r["k"] == k]
    out = {}

    def verdict(value, why):
        return {"verdict": value or "inconclusive", "why": why}

    # H1
    value, why = _agreement(doc, PAIRS[:3], k)
    cosines = [_adapter_cosine(doc, k, s) for s in SEEDS]
    if value != "falsified":
        if None in cosines:
            value, why = (
                None,
                why
                + "; adapter cosine missing for seeds "
                + str([s for s, c in zip(SEEDS, cosines, strict=True) if c is None]),
            )
        elif min(cosines) < COSINE_LIMIT:
            value, why = "falsified", f"adapter cosine {min(cosines):.3f} < {COSINE_LIMIT}"
        else:
            why += f"; adapter cosine >= {COSINE_LIMIT} in every seed (min {min(cosines):.3f})"
    out["H1"] = verdict(value, why)
    # H2
    value, why = _agreement(doc, PAIRS[3:4], k)
    travel = [r.get("head_travel") for r in rows if r["arm"] in ("calm_vector", "calm_scalar")]
    seeds_seen = {(r["arm"], r["seed"]) for r in rows if r["arm"] in ("calm_vector", "calm_scalar")}
    if value != "falsified":
        if len(seeds_seen) < 2 * len(SEEDS) or None in travel:
            value, why = None, why + "; head travel not measured for every seed"
        elif max(travel) > TRAVEL_LIMIT:
            value, why = "falsified", f"head travel {max(travel):.2e} > {TRAVEL_LIMIT:g}"
        else:
            why += f"; head travel <= {TRAVEL_LIMIT:g} (max {max(travel):.2e})"
    out["H2"] = verdict(value, why)
    # H3
    base = _row(rows, "base", k, 0)
    wins, missing = 0, []
    for seed in SEEDS:
        found = _comparison(doc, "ts", "calm_vector", "conf_ece", seed, k)
        calm = _row(rows, "calm_vector", k, seed)
        if found is None or calm is None or base is None:
            missing.append(seed)
            continue
        wins += found["ci95"][1] < 0 and calm["accuracy"] >= ACCURACY_FLOOR * base["accuracy"]
    if wins >= 2:
        out["H3"] = verdict(
            "held",
            f"calm_vector below TS-OOD outside the interval in {wins} "
            "seeds at >= 0.8 x base accuracy",
        )
    elif wins + len(missing) < 2:
        out["H3"] = verdict(
            "falsified",
            f"calm_vector below TS-OOD outside the interval (at "
            f">= 0.8 x base accuracy) in {wins} of {len(SEEDS)} seeds",
        )
    else:
        out["H3"] = verdict(None, f"{wins} win(s) so far; no comparison yet for seeds {missing}")
    # H4
    value, why = _agreement(doc, PAIRS[5:6], k)
    out["H4"] = verdict(value, why)
    return out


# ----- rendering -----


def _ms(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f}"


def markdown(doc: dict) -> str:
    lines = [
        "# Is CALM entropy regularisation with α = 1/λ? (study results)",
        "",
        "Regenerate: `python studies/entropy_equivalence.py --render-only` (runs: "
        "`python studies/entropy_equivalence.py`); raw records in "
        "`results/entropy_equivalence.json`. Write-up: "
        "[docs/studies/entropy_equivalence.md](../docs/studies/entropy_equivalence.md).",
        "",
        f"**Hypotheses, stated {doc['hypotheses'].get('stated', '?')} before any run:**",
        "",
    ]
    for name in ("H1", "H2", "H3", "H4"):
        h = doc["hypotheses"][name]
        lines += [f"* **{name}** {h['statement']}. Test: {h['test']}"]
    if doc["hypotheses"].get("caveat"):
        lines += ["", f"Caveat, stated with them: {doc['hypotheses']['caveat']}"]
    lines += ["", f"**Protocol.** {doc['protocol']}", "", "## Outcomes", ""]
    for name, o in doc["outcomes"].items():
        lines.append(f"* **{name}: {o['verdict']}**: {o['why']}")
    for key, cell in doc["other_k"].items():
        lines += [
            "",
            f"## Outcomes at k = {key} (rule stated {cell['stated']})",
            "",
            cell["rule"],
            "",
        ]
        for name, o in cell["outcomes"].items():
            lines.append(f"* **{name}: {o['verdict']}**: {o['why']}")
    if doc["selection"]:
        lines += [
            "",
            "## Lower-LR selection (held-out split, seed 0)",
            "",
            "| k | run | accuracy | conf-ECE | NLL |",
            "|---|---|---|---|---|",
        ]
        for r in sorted(doc["selection"], key=lambda r: (r["k"], r["arm"])):
            lines.append(
                f"| {r['k']:g} | {r['arm']} | {r['accuracy']:.4f} | "
                f"{r['conf_ece']:.4f} | {r['nll']:.4f} |"
            )
    if doc["rows"]:
        lines += [
            "",
            "## Test split, mean ± sd over seeds",
            "",
            "| k | arm | seeds | accuracy | NLL | conf-ECE | α | λ̄ | head travel |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for k in sorted({r["k"] for r in doc["rows"]}):
            for arm in ("base", "ts", *ARMS):
                rs = [r for r in doc["rows"] if (r["k"], r["arm"]) == (k, arm)]
                if rs:
                    alpha = [r["alpha"] for r in rs if r.get("alpha") is not None]
                    travel = [r.get("head_travel") for r in rs if r.get("head_travel") is not None]
                    lines.append(
                        f"| {k:g} | {arm} | {len(rs)} | {_ms([r['accuracy'] for r in rs])} | "
                        f"{_ms([r['nll'] for r in rs])} | {_ms([r['conf_ece'] for r in rs])} | "
                        f"{f'{statistics.fmean(alpha):.3g}' if alpha else '–'} | "
                        f"{_ms([r.get('lambda_mean') for r in rs])} | "
                        f"{f'{max(travel):.2e}' if travel else '–'} |"
                    )
    if doc["adapter_pairs"]:
        lines += [
            "",
            "## Adapter weight deltas (ΔW = (α/r) B A, every adapted matrix)",
            "",
            "| k | seed | a | b | cosine | ‖ΔW_a − ΔW_b‖ / ‖ΔW_a‖ |",
            "|---|---|---|---|---|---|",
        ]
        for p in sorted(doc["adapter_pairs"], key=lambda p: (p["k"], p["a"], p["b"], p["seed"])):
            lines.append(
                f"| {p['k']:g} | {p['seed']} | {p['a']} | {p['b']} | "
                f"{p['cosine']:.4f} | {p['relative_difference']:.4f} |"
            )
    if doc["comparisons"]:
        lines += [
            "",
            "## Paired bootstrap (b − a on the same test questions, 95 % interval, "
            "2,000 resamples)",
            "",
            "| k | seed | a | b | metric | a | b | b − a | 95 % interval |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for c in sorted(doc["comparisons"], key=_key):
            low, high = c["ci95"]
            lines.append(
                f"| {c['k']:g} | {c['seed']} | {c['a']} | {c['b']} | {c['metric']} | "
                f"{c['value_a']:.4f} | {c['value_b']:.4f} | {c['difference']:+.4f} | "
                f"[{low:+.4f}, {high:+.4f}] |"
            )
    if not doc["rows"]:
        lines += ["", "No runs yet."]
    return "\n".join(lines) + "\n"


def figure(doc: dict, path: Path) -> None:
    """conf-ECE per arm (every seed, with TS-OOD and base), one panel per k, and lambda_t of
    the CALM arms (k = 1 solid, another k dashed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ks = sorted({r["k"] for r in doc["rows"]}) or [1.0]
    fig = Figure(figsize=(5 * (len(ks) + 1), 3.8))
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(1, len(ks) + 1, i + 1) for i in range(len(ks) + 1)]
    for ax, k in zip(axes, ks, strict=False):
        rows = [r for r in doc["rows"] if r["k"] == k]
        for ref, style in (("base", ":"), ("ts", "--")):
            r = _row(rows, ref, k, 0)
            if r:
                ax.axhline(r["conf_ece"], linestyle=style, color="grey", label=f"{ref} (test)")
        for i, arm in enumerate(ARMS):
            values = [r["conf_ece"] for r in rows if r["arm"] == arm]
            ax.plot([i] * len(values), values, "o", color=f"C{i}")
            if values:
                ax.plot([i - 0.25, i + 0.25], [statistics.fmean(values)] * 2, color=f"C{i}")
        ax.set_xticks(range(len(ARMS)))
        ax.set_xticklabels(ARMS, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(f"test conf-ECE (k = {k:g})", fontsize=8)
        ax.set_title(f"k = {k:g}: every seed, mean as a bar", fontsize=9)
        if not rows:
            ax.text(0.5, 0.5, "no runs yet", transform=ax.transAxes, ha="center")
    ax_l = axes[-1]
    for k in ks:
        for i, arm in enumerate(CALM_ARMS):
            for r in doc["rows"]:
                if (r["arm"], r["k"]) == (arm, k) and r.get("lambda_t"):
                    ax_l.plot(
                        range(1, len(r["lambda_t"]) + 1),
                        r["lambda_t"],
                        color=f"C{i}",
                        linestyle="-" if k == 1.0 else "--",
                        alpha=0.8,
                        label=f"{arm} (k = {k:g})" if r["seed"] == min(SEEDS) else None,
                    )
    ax_l.set_xlabel("outer step", fontsize=8)
    ax_l.set_ylabel("λ_t", fontsize=8)
    ax_l.set_title("λ over the run (reg_lambda uses 1 / its mean)", fontsize=9)
    for axis in axes:
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=7)
    fig.suptitle("setting=demo (OOD): paper-form CALM against reg and sft", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def render(results: Path) -> dict:
    doc = load(results)
    compute_comparisons(doc)
    for k, seed in sorted({(r["k"], r["seed"]) for r in doc["rows"]}):
        update_adapter_pairs(doc, k, seed)
    all_outcomes(doc)
    study_runs.save(results, doc)
    results.with_suffix(".md").write_text(markdown(doc))
    figure(doc, results.with_suffix(".png"))
    for name, o in doc["outcomes"].items():
        print(f"{name}: {o['verdict']} ({o['why']})")
    for key, cell in doc["other_k"].items():
        for name, o in cell["outcomes"].items():
            print(f"k={key} {name}: {o['verdict']} ({o['why']})")
    print(f"wrote {results}, {results.with_suffix('.md')} and {results.with_suffix('.png')}")
    return doc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, help=f"default {RESULTS.relative_to(ROOT)}")
    parser.add_argument("--outputs", type=Path, help="run folders (default outputs/...)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS))
    parser.add_argument("--k", type=float, nargs="+", default=[1.0], help="logit scales")
    parser.add_argument("--dry-run", action="store_true", help="print the runs, run nothing")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument(
        "--hypotheses-only",
        action="store_true",
        help="write the hypotheses into the results file and stop",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"model=tiny, {SMOKE_STEPS} steps, results under outputs/",
    )
    args = parser.parse_args()
    outputs = args.outputs or ROOT / "outputs" / (
        "entropy_equivalence_smoke" if args.smoke else "entropy_equivalence"
    )
    results = args.results or (outputs / RESULTS.name if args.smoke else RESULTS)
    if args.smoke:
        study_runs.EXTRA.update({"model": "tiny"})
    if args.render_only:
        render(results)
        return
    study = Study(results, outputs, SMOKE_STEPS if args.smoke else STEPS, args.dry_run)
    state_other_k(study.doc, args.k)
    all_outcomes(study.doc)
    study.save()  # the hypotheses are on record before the first run
    if args.hypotheses_only:
        results.with_suffix(".md").write_text(markdown(study.doc))
        print(f"hypotheses written to {results} and {results.with_suffix('.md')}")
        return
    for k in args.k:
        study.cell(k, args.seeds, args.arms)
    if not args.dry_run:
        render(results)


if __name__ == "__main__":
    main()
