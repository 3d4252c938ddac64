"""The report's paired comparisons: each selected method against the untouched model (`base`)
and against a reference method (`ts` unless told), on the same questions.

Two rows are paired question by question through the ids of their predictions.jsonl (only the
ids both scored count; the table says how many). Against base a run's own base row (its base/
folder) is used, else the base run of the same seed; against the reference, its selected run
of the same seed (else its first). With several seeds each pair is resampled on its own
questions and the differences are averaged replicate by replicate (metrics/bootstrap.py).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from calm_lightning.metrics.bootstrap import BootstrapSettings, ScoredQuestions, paired_differences
from calm_lightning.metrics.names import BY_KEY
from calm_lightning.reporting.selection import (
    BASE_ROW,
    Choice,
    calibration_key,
    method_order,
    table_positions,
)
from calm_lightning.runtime.run_record import BASE_DIR, PREDICTIONS_FILE, read_predictions

DEFAULT_REFERENCE = "ts"


def _rows(folder: Path, cache: dict) -> dict[str, dict]:
    if folder not in cache:
        path = folder / PREDICTIONS_FILE
        cache[folder] = {r["id"]: r for r in read_predictions(folder)} if path.is_file() else {}
    return cache[folder]


def _scored(rows: list[dict], n_bins: int) -> ScoredQuestions:
    """A row's questions ready to resample: option vectors with the stated answer (MCQA), else
    the sampled answers' (confidence, correct) pairs (open QA)."""
    if "probs" in rows[0]:
        probs = np.array([r["probs"] for r in rows], dtype=np.float64)
        probs /= probs.sum(1, keepdims=True)  # stored to 6 digits: back onto the simplex
        labels = np.array([r["label"] for r in rows])
        stated = np.array([r["prediction"] for r in rows])
        return ScoredQuestions.from_probs(probs, labels, stated, n_bins)
    return ScoredQuestions(
        [r["confidence"] for r in rows], [r["correct"] for r in rows], n_bins=n_bins
    )


def _reference_folder(run, reference: str, by_method: dict) -> Path | None:
    if reference == BASE_ROW and (run.path / BASE_DIR / PREDICTIONS_FILE).is_file():
        return run.path / BASE_DIR
    choice = by_method.get(reference)
    if choice is None:
        return None
    same_seed = [r for r in choice.runs if r.seed == run.seed]
    return (same_seed or choice.runs)[0].path


def _pairs(choice: Choice, reference: str, by_method: dict, cache: dict, n_bins: int):
    """(a = reference, b = method) per seed, on the ids both scored; and how many ids."""
    pairs, shared_total = [], 0
    for run in choice.runs:
        folder = _reference_folder(run, reference, by_method)
        if folder is None:
            continue
        mine, theirs = _rows(run.path, cache), _rows(folder, cache)
        shared = [i for i in mine if i in theirs]
        if not shared:
            continue
        a = _scored([theirs[i] for i in shared], n_bins)
        b = _scored([mine[i] for i in shared], n_bins)
        pairs.append((a, b))
        shared_total += len(shared)
    return pairs, shared_total


def paired_table(
    choices: list[Choice],
    reference: str = DEFAULT_REFERENCE,
    settings: BootstrapSettings | None = None,
    n_bins: int = 10,
) -> str:
    """Per (model, setting): method − base and method − `reference` of the calibration error
    and AUROC, each with its paired-bootstrap interval, * where it excludes 0."""
    settings = settings or BootstrapSettings(smece_resamples=0)
    positions = table_positions(choices)
    groups = defaultdict(dict)
    for choice in choices:
        groups[(choice.model, choice.setting)][choice.method] = choice
    parts, cache = [], {}
    for (model, setting), by_method in sorted(groups.items()):
        references = list(dict.fromkeys([BASE_ROW, reference]))
        key = calibration_key(next(iter(by_method.values())).mean)
        shown = [(ref, k) for ref in references for k in (key, "auroc")]
        parts.append(f"#### {model} / {setting}: paired differences\n")
        header = [f"Δ {BY_KEY[k].column} vs {ref}" for ref, k in shown]
        parts.append("| method | " + " | ".join(header) + " | questions |")
        parts.append("|---|" + "---|" * (len(shown) + 1))
        for method in sorted(by_method, key=lambda m: method_order(m, positions)):
            cells, counts = [], []
            for ref in references:
                if ref == method:
                    cells += ["-", "-"]
                    continue
                pairs, shared = _pairs(by_method[method], ref, by_method, cache, n_bins)
                if not pairs:
                    cells += ["-", "-"]
                    continue
                # Sem-ECE is conf-ECE's formula over the sampled answers' pairs
                out = paired_differences(pairs, ("conf_ece", "auroc"), settings)
                cells += [_difference(out["conf_ece"]), _difference(out["auroc"])]
                counts.append(f"{shared} ({ref})")
            if any(c != "-" for c in cells):
                parts.append(f"| {method} | " + " | ".join(cells) + f" | {', '.join(counts)} |")
        if reference not in by_method:
            parts.append(f"\n(no `{reference}` run in this table: no comparison against it)")
        parts.append("")
    note = (
        f"Paired differences: method − reference on the questions both scored (ids matched; "
        f"seeds paired by seed and averaged); [lo, hi]: 95 % paired-bootstrap interval over "
        f"questions ({settings.resamples} resamples); * the interval excludes 0. A negative "
        "Δ conf-ECE is better calibrated, a positive Δ AUROC ranks right answers higher.\n"
    )
    return "\n".join([*parts, note])


def _difference(result) -> str:
    low, high = result.ci95
    if low is None:
        return f"{result.difference:+.4f}"
    mark = " *" if result.excludes_zero else ""
    return f"{result.difference:+.4f} [{low:+.4f}, {high:+.4f}]{mark}"
