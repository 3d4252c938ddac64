"""Sem-ECE pieces on hand-made answer sets: normalisation, grading, clustering, the metric."""

from __future__ import annotations

import pytest

from calm_lightning.calibration.semantic import (
    cluster_exact,
    grade,
    is_unattempted,
    modal_answer,
    normalize_answer,
    semantic_ece,
    token_f1,
)


def test_normalisation():
    assert normalize_answer("  The Beatles! ") == "beatles"
    assert normalize_answer("São Paulo") == "sao paulo"
    assert normalize_answer("U.S.A.") == "usa"
    assert normalize_answer("An apple, a day") == "apple day"


def test_grading_against_aliases():
    aliases = ["Green", "green colour"]
    assert grade("green.", aliases)
    assert grade("It is green", aliases)  # contains the alias as whole words
    assert not grade("greenish", aliases)  # no whole-word match, F1 0
    assert grade("Barack Obama", ["Obama"])  # containment
    assert not grade("I don't know", ["I don't know"])  # abstentions are never correct
    assert token_f1("New York City", "new york") == pytest.approx(0.8)
    assert grade("new york city", ["New York"], containment=False, f1_threshold=0.8)
    assert not grade("new york city", ["New York"], containment=False, f1_threshold=0.9)


def test_unattempted_answers():
    assert is_unattempted("I do not know.") and is_unattempted("")
    assert not is_unattempted("Paris")


def test_clustering_and_modal_answer():
    samples = ["Paris", "paris.", "The Paris", "Lyon", "lyon", "Marseille"]
    assert cluster_exact(samples) == [0, 0, 0, 1, 1, 2]
    pred = modal_answer(samples)
    assert pred.answer == "Paris" and pred.confidence == pytest.approx(0.5)
    assert pred.n_clusters == 3 and not pred.unattempted
    # A tie goes to the cluster that appeared first.
    assert modal_answer(["b", "a", "a", "b"]).answer == "b"
    # A pluggable clusterer: everything is one cluster.
    assert modal_answer(samples, clusterer=lambda xs: [0] * len(xs)).confidence == 1.0


def test_semantic_ece_by_hand():
    # Bin 9 (conf 0.95, 1.0): one right, one wrong -> |0.5 - 0.975| = 0.475, weight 2/4.
    # Bin 4 (0.45): right -> |1 - 0.45| = 0.55, weight 1/4. Bin 2 (0.25): wrong -> 0.25, 1/4.
    confidences = [0.95, 1.0, 0.45, 0.25]
    correct = [True, False, True, False]
    expected = 0.5 * 0.475 + 0.25 * 0.55 + 0.25 * 0.25
    assert semantic_ece(confidences, correct) == pytest.approx(expected)
