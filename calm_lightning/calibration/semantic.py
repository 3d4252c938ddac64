"""Sem-ECE building blocks for open-ended answers: normalisation, grading against gold aliases,
clustering of equivalent samples, and the ECE over cluster-share confidences.

Sem-ECE (Wang et al. 2026, as the CALM paper uses it): for each question draw n answers,
cluster equivalent ones, confidence = share of the largest cluster, correct = that cluster's
answer matches a gold alias; then the usual 10-bin ECE over (confidence, correct).
The clusterer here is normalised exact match; a semantic clusterer (embeddings, NLI or an
LLM judge) plugs in through the same `Clusterer` signature.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from calm_lightning.calibration.metrics import reliability_bins

ARTICLES = re.compile(r"\b(a|an|the)\b")
UNATTEMPTED = ("i don't know", "i do not know", "unknown", "not sure", "no idea", "cannot answer")

Clusterer = Callable[[Sequence[str]], list[int]]


def normalize_answer(text: str) -> str:
    """Lower-case, strip accents, delete punctuation (as SQuAD does: "U.S.A." -> "usa"),
    drop articles, collapse whitespace."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = ARTICLES.sub(" ", text)
    return " ".join(text.split())


def is_unattempted(answer: str) -> bool:
    """An abstention such as "I don't know" (counted separately, never correct)."""
    norm = normalize_answer(answer)
    return not norm or any(normalize_answer(u) in norm for u in UNATTEMPTED)


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD-style token F1 between normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def grade(
    answer: str, aliases: Sequence[str], f1_threshold: float = 0.8, containment: bool = True
) -> bool:
    """Correct when the normalised answer equals an alias, contains it (or is contained in it)
    as whole words, or reaches `f1_threshold` token F1 with one."""
    if is_unattempted(answer):
        return False
    norm = normalize_answer(answer)
    for alias in aliases:
        gold = normalize_answer(alias)
        if not gold:
            continue
        if norm == gold:
            return True
        if containment and (f" {gold} " in f" {norm} " or f" {norm} " in f" {gold} "):
            return True
        if token_f1(norm, gold) >= f1_threshold:
            return True
    return False


def cluster_exact(answers: Sequence[str]) -> list[int]:
    """Cluster ids by normalised exact match (ids in order of first appearance)."""
    ids: dict[str, int] = {}
    return [ids.setdefault(normalize_answer(a), len(ids)) for a in answers]


@dataclass
class SemanticPrediction:
    """One question's samples reduced to its modal answer and confidence."""

    answer: str  # a representative of the largest cluster
    confidence: float  # share of the samples in the largest cluster
    n_clusters: int
    unattempted: bool


def modal_answer(
    samples: Sequence[str], clusterer: Clusterer = cluster_exact
) -> SemanticPrediction:
    """The largest cluster (ties: the one whose first member came first) and its share."""
    if not samples:
        raise ValueError("no samples to cluster")
    ids = clusterer(samples)
    counts = Counter(ids)
    best = max(counts, key=lambda c: (counts[c], -ids.index(c)))
    representative = samples[ids.index(best)]
    return SemanticPrediction(
        representative, counts[best] / len(samples), len(counts), is_unattempted(representative)
    )


def semantic_ece(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = 10) -> float:
    """ECE over (largest-cluster share, modal answer correct), equal-width bins."""
    bins = reliability_bins(np.asarray(confidences, dtype=float), np.asarray(correct), n_bins)
    return bins.expected_gap()
