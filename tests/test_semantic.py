"""Sem-ECE pieces on hand-made answer sets: normalisation, grading, clustering, the metric."""

from __future__ import annotations

import pytest

from calm_lightning.metrics.semantic import (
    EmbeddingClusterer,
    answer_core,
    cluster_exact,
    extract_answer,
    grade,
    is_unattempted,
    modal_answer,
    normalize_answer,
    numbers_in,
    semantic_ece,
    split_half_answer,
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


def test_answer_extraction():
    assert extract_answer("Answer: Paris.\nParis is the capital.") == "Paris"
    assert extract_answer('  "The Beatles"  ') == "The Beatles"
    assert extract_answer("\n\n**Mount Everest**") == "Mount Everest"
    assert extract_answer("A: 1969") == "1969"
    assert extract_answer("Wait...") == "Wait..."
    assert extract_answer("") == ""


def test_numbers_in_answers():
    assert numbers_in("three metres") == numbers_in("3 meters") == {"3"}
    assert numbers_in("1,000 people") == {"1000"}
    assert numbers_in("Paris") == frozenset()


@pytest.fixture(scope="module")
def minilm():
    return EmbeddingClusterer()


def _same(ids, i, j):
    return ids[i] == ids[j]


def test_embedding_clusterer_merges_paraphrases_and_name_forms(minilm):
    answers = ["Barack Obama", "President Obama", "Obama", "Barack H. Obama", "Joe Biden"]
    ids = minilm(answers)
    assert len({ids[0], ids[1], ids[2], ids[3]}) == 1
    assert ids[4] != ids[0]
    ids = minilm(["William Shakespeare", "Shakespeare", "Christopher Marlowe"])
    assert ids[0] == ids[1] != ids[2]
    ids = minilm(["Mount Everest", "Everest", "K2", "the Mount Everest"])
    assert ids[0] == ids[1] == ids[3] != ids[2]


def test_embedding_clusterer_units_and_numbers(minilm):
    ids = minilm(["100 km", "100 kilometers", "100 miles", "200 km"])
    assert ids[0] == ids[1]
    assert len({ids[0], ids[2], ids[3]}) == 3  # other unit, other number: different answers
    ids = minilm(["3 meters", "three metres", "1969", "in 1969", "1970"])
    assert ids[0] == ids[1] and ids[2] == ids[3] != ids[4]


def test_embedding_clusterer_keeps_different_entities_apart(minilm):
    answers = ["Paris", "London", "Lyon", "Pacific Ocean", "Atlantic Ocean", "a dog", "a cat"]
    assert len(set(minilm(answers))) == len(answers)
    # Exact matches are one cluster whatever the embeddings say; a single answer is one cluster.
    assert minilm(["Paris", "paris.", "The Paris"]) == [0, 0, 0]
    assert minilm(["Paris"]) == [0]


def test_modal_answer_with_embedding_clusters(minilm):
    samples = ["Obama", "Joe Biden", "Barack Obama", "Barack Obama", "Biden", "Barack Obama"]
    pred = modal_answer(samples, minilm)
    # Obama forms 4 of 6; the representative is the most frequent spelling.
    assert pred.answer == "Barack Obama" and pred.confidence == pytest.approx(4 / 6)
    assert grade(pred.answer, ["Barack Hussein Obama", "Obama"])


def test_split_half_confidence():
    samples = ["Rome", "Rome", "Oslo", "Rome", "Oslo", "Oslo", "Oslo", "Rome"]
    # First half: Rome (3 of 4) -> answer Rome; the second half holds Rome once in four draws.
    pred = split_half_answer(samples)
    assert pred.answer == "Rome" and pred.confidence == pytest.approx(0.25)
    assert modal_answer(samples).confidence == pytest.approx(0.5)
    with pytest.raises(ValueError):
        split_half_answer(["Rome"])


def test_sentence_answers_reduce_to_their_core():
    question = "What is the capital of Botswana?"
    assert answer_core("The capital of Botswana is Gaborone.", question) == "gaborone"
    assert answer_core("It's Gaborone", question) == "gaborone"
    assert answer_core("Botswana", question) == "botswana"  # only question words: kept whole
    samples = ["The capital of Botswana is Khartoum", "Khartoum", "Gaborone", "It is Gaborone."]
    assert cluster_exact(samples, question) == [0, 0, 1, 1]
    # The question's own numbers do not count as the answer's.
    minutes = "How many minutes are in 11 days?"
    assert answer_core("There are 15840 minutes in 11 days", minutes) == "15840"


def test_embedding_clusterer_uses_the_question(minilm):
    question = "What is the capital of Botswana?"
    samples = [
        "The capital of Botswana is Khartoum",
        "The capital of Botswana is Cape Town",
        "Gaborone",
        "The capital city of Botswana is Gaborone",
    ]
    ids = minilm(samples, question)
    assert ids[2] == ids[3] and len({ids[0], ids[1], ids[2]}) == 3
