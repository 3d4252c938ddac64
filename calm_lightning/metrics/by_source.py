"""A row's spread over its questions: metrics.json's `ci95` (a bootstrap interval per metric)
and, for a test pooled from several sources, `by_source` (each source's own numbers with their
intervals, and their unweighted macro average).

A pooled ECE mixes calibration with composition: two sources that are each well calibrated but
at different accuracies can pool into bins that are not, and the reverse. The per-source rows
say which source carries a change. A source with fewer than `MIN_QUESTIONS` questions keeps its
row, marked `few_questions`, because its numbers are mostly noise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from calm_lightning.metrics.bootstrap import (
    BootstrapSettings,
    ScoredQuestions,
    intervals,
    percentile_interval,
    resampled_values,
)

MIN_QUESTIONS = 30
SOURCE_KEYS = ("accuracy", "conf_ece", "nll", "brier")  # nll and brier need option vectors


def question_spread(
    make_row: Callable[[np.ndarray | None], ScoredQuestions],
    sources: list[str] | None,
    settings: BootstrapSettings,
    rename: dict[str, str] | None = None,
) -> dict:
    """`ci95` of the whole row and, when `sources` (one per question) names two or more,
    `by_source`. `make_row(index)` builds the row on the questions `index` (None: all);
    `rename` maps the bootstrap's keys to the row's own (open QA: conf_ece -> sem_ece)."""
    rename = rename or {}
    whole = make_row(None)
    out = {"ci95": _renamed(intervals(whole, settings), rename)}
    names = sorted({s for s in sources or () if s is not None})
    if len(names) > 1:
        source_of = np.array(sources, dtype=object)
        rows = {name: make_row(np.flatnonzero(source_of == name)) for name in names}
        out["by_source"] = _source_rows(rows, settings, rename)
    return out


def _renamed(values: dict, rename: dict[str, str]) -> dict:
    return {rename.get(k, k): v for k, v in values.items()}


def _source_rows(
    rows: dict[str, ScoredQuestions], settings: BootstrapSettings, rename: dict[str, str]
) -> dict:
    """Each source's metrics with intervals, and the macro average (each source resampled on
    its own, replicate by replicate: a stratified bootstrap of the average)."""
    keys = tuple(k for k in SOURCE_KEYS if k in next(iter(rows.values())).keys)
    out, samples = {}, []
    for i, (name, row) in enumerate(rows.items()):
        point = row.point(keys)
        own = BootstrapSettings(settings.resamples, settings.seed + 1 + i, 0)
        drawn = resampled_values([row], keys, own)[0] if settings.resamples else {}
        samples.append(drawn)
        entry = _renamed(point, rename) | {"n": row.n, "few_questions": row.n < MIN_QUESTIONS}
        if drawn:
            entry["ci95"] = _renamed({k: percentile_interval(v) for k, v in drawn.items()}, rename)
        out[name] = entry
    macro = {
        rename.get(k, k): float(np.mean([out[s][rename.get(k, k)] for s in out])) for k in keys
    }
    macro |= {"n": sum(r.n for r in rows.values()), "sources": len(rows)}
    if settings.resamples:
        averaged = {k: np.mean([s[k] for s in samples], 0) for k in keys}
        macro["ci95"] = _renamed({k: percentile_interval(v) for k, v in averaged.items()}, rename)
    return {"sources": out, "macro": macro, "min_questions": MIN_QUESTIONS}
