"""The test pass without Lightning or a model: batches from two processes come back in the
single-process order, each question counts once, and the metrics are the numpy ones."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from calm_lightning.data.records import MCQARecord
from calm_lightning.evaluation.evaluator import ScoredOptions, TestEvaluator
from calm_lightning.evaluation.mcqa import OptionTokens
from calm_lightning.evaluation.scorers import CLOZE_OPTION_TOKENS, ClozeScorer, LetterScorer

ANSWERS = [1, 0, 3, 2, 0]
RECORDS = [
    MCQARecord(f"q{i}", f"question {i}", ("a", "b", "c", "d"), answer)
    for i, answer in enumerate(ANSWERS)
]


def _loader(n_global=None):
    """What the evaluator reads of a test loader: its dataset and its sampler's `n_global`."""
    return SimpleNamespace(dataset=RECORDS, batch_sampler=SimpleNamespace(n_global=n_global))


def _batch(indices: list[int], rng) -> tuple[dict, ScoredOptions]:
    """A collated batch of these questions and made-up scores for it."""
    batch = {
        "ids": [RECORDS[i].id for i in indices],
        "labels": torch.tensor([ANSWERS[i] for i in indices]),
    }
    probs = torch.from_numpy(rng.dirichlet(np.ones(4), size=len(indices)))
    side = torch.from_numpy(rng.integers(0, 4, size=len(indices)))
    return batch, ScoredOptions(probs, side=side)


def _numpy_metrics(probs: np.ndarray, labels: np.ndarray, n_bins: int = 10) -> dict:
    """Accuracy, conf-ECE, NLL, Brier and mean confidence, written out with numpy."""
    confidence, answer = probs.max(1), probs.argmax(1)
    correct = answer == labels
    bins = np.minimum((confidence * n_bins).astype(int), n_bins - 1)
    ece = sum(
        abs(correct[bins == b].mean() - confidence[bins == b].mean()) * (bins == b).sum()
        for b in np.unique(bins)
    ) / len(labels)
    onehot = np.eye(probs.shape[1])[labels]
    return {
        "accuracy": correct.mean(),
        "conf_ece": ece,
        "nll": -np.log(probs[np.arange(len(labels)), labels]).mean(),
        "brier": ((probs - onehot) ** 2).sum(1).mean(),
        "mean_confidence": confidence.mean(),
        "n": len(labels),
    }


def test_two_processes_gather_in_order_count_each_question_once_and_report():
    rng = np.random.default_rng(0)
    # Global batches of two go to the processes in turn: rank 0 scores batches 0 and 2, rank 1
    # batch 1 and, idle at the end, a copy of batch 0 (index 3 >= n_global: dropped). Batch 2
    # ends with a padding repeat of q0 (a padding sampler's), which must count once.
    (b0, s0), (b1, s1), (b2, s2), (idle, s_idle) = (
        _batch(ix, rng) for ix in ([0, 1], [2, 3], [4, 0], [0, 1])
    )
    sent: list = []
    rank1 = TestEvaluator(
        ClozeScorer(), gather=lambda mine: sent.append(mine) or [mine], world=lambda: (1, 2)
    )
    rank0 = TestEvaluator(ClozeScorer(), gather=lambda mine: [mine, sent[0]], world=lambda: (0, 2))
    for evaluator in (rank0, rank1):  # cloze reads no probe: no model needed to start
        assert evaluator.start(_loader(n_global=3), None, None, "cpu") == CLOZE_OPTION_TOKENS
    rank0.add(b0, 0, s0)
    rank1.add(b1, 0, s1)
    rank0.add(b2, 1, s2)
    rank1.add(idle, 1, s_idle)
    rank1.finish()  # all_gather: rank 1 sends its batches
    metrics = rank0.finish()

    predictions = rank0.predictions
    assert predictions.ids == ["q0", "q1", "q2", "q3", "q4"]
    kept = [(s0, 0), (s0, 1), (s1, 0), (s1, 1), (s2, 0)]  # q0's first scores, not the repeat
    probs = np.stack([scored.probs[row].numpy() for scored, row in kept])
    side = np.array([int(scored.side[row]) for scored, row in kept])
    labels = np.array(ANSWERS)
    np.testing.assert_array_equal(predictions.probs, probs)
    np.testing.assert_array_equal(predictions.labels, labels)
    assert predictions.option_tokens == CLOZE_OPTION_TOKENS and predictions.predicted is None
    expected = _numpy_metrics(probs, labels)
    for key, value in expected.items():
        assert metrics[key] == pytest.approx(value, abs=1e-12), key
    assert metrics["acc_norm"] == pytest.approx((side == labels).mean())  # the side choices


def test_stated_answers_count_for_accuracy_and_an_earlier_choice_of_tokens_holds():
    tokens = OptionTokens("space", (10, 11, 12, 13), "ABCD")
    evaluator = TestEvaluator(LetterScorer(), n_bins=5)  # one process: the real gather
    # The run already chose its tokens (the base row's): no probe, so no model is read.
    assert evaluator.start(_loader(), None, None, "cpu", option_tokens=tokens) == tokens
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 5, dtype=torch.float64)
    stated = torch.tensor([1, 0, 3, 0, 0])
    batch = {"ids": [r.id for r in RECORDS], "labels": torch.tensor(ANSWERS)}
    evaluator.add(batch, 0, ScoredOptions(probs, stated))
    metrics = evaluator.finish()
    assert metrics["accuracy"] == pytest.approx(np.mean(stated.numpy() == np.array(ANSWERS)))
    assert "acc_norm" not in metrics  # letter scoring makes no side choices
    np.testing.assert_array_equal(evaluator.predictions.predicted, stated.numpy())
    assert evaluator.predictions.option_tokens == tokens
