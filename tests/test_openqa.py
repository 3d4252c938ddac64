"""Open-ended QA evaluation: Sem-ECE bookkeeping by hand, the sampler against `generate`, label
smoothing over the vocabulary, and setting=gen_ood end to end on the tiny model with local
files in the hub's schemas."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from calm_lightning.evaluation.openqa import OpenQAPredictions, OpenQASettings
from calm_lightning.evaluation.sampling import sample_answers
from calm_lightning.methods.single_level import smoothed_vocab_cross_entropy
from calm_lightning.metrics.semantic import grade
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.pipeline import run_experiment


def _hand_ece(confidences, correct, n_bins=10):
    bins: dict[int, list] = {}
    for c, y in zip(confidences, correct, strict=True):
        bins.setdefault(min(int(c * n_bins), n_bins - 1), []).append((c, y))
    n = len(confidences)
    return sum(
        len(m) / n * abs(sum(y for _, y in m) / len(m) - sum(c for c, _ in m) / len(m))
        for m in bins.values()
    )


def test_openqa_report_by_hand():
    rows = [
        {"id": "a", "confidence": 0.9, "correct": True, "unattempted": False, "n_clusters": 2},
        {"id": "b", "confidence": 0.95, "correct": False, "unattempted": False, "n_clusters": 1},
        {"id": "c", "confidence": 0.3, "correct": False, "unattempted": True, "n_clusters": 5},
        {"id": "d", "confidence": 1.0, "correct": True, "unattempted": False, "n_clusters": 1},
    ]
    report = OpenQAPredictions(rows, OpenQASettings()).report()
    # Bin 9: (0.9, 1), (0.95, 0), (1.0, 1) -> |2/3 - 0.95| * 3/4; bin 3: |0 - 0.3| * 1/4.
    assert report["sem_ece"] == pytest.approx(0.75 * abs(2 / 3 - 0.95) + 0.25 * 0.3)
    assert report["accuracy"] == 0.5 and report["unattempted"] == 0.25
    assert report["mean_confidence"] == pytest.approx(0.7875)
    assert report["mean_clusters"] == 2.25 and report["n"] == 4


def test_settings_refuse_unknown_confidence():
    from calm_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="split_half"):
        OpenQASettings(confidence="mean")


@pytest.mark.integration
def test_sampler_token_frequencies_match_generate(tiny_loaded):
    """First answer token over many draws: the cached sampler and `generate(do_sample=True)`
    both follow the model's own next-token distribution."""
    lm, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    model = CalibratedLM(lm).eval()
    prompt = "Question: name a colour. Answer:"
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(lm(ids).logits[0, -1].double(), -1)
    n = 2000
    ours = sample_answers(model, tokenizer, [prompt], n=n, max_new_tokens=1, seed=0)[0]
    torch.manual_seed(0)
    with torch.no_grad():
        theirs = lm.generate(
            ids.repeat(n, 1),
            attention_mask=torch.ones(n, ids.shape[1], dtype=torch.long),
            do_sample=True,
            top_k=0,
            top_p=1.0,
            temperature=1.0,
            max_new_tokens=1,
            pad_token_id=tokenizer.pad_token_id,
        )[:, -1].tolist()
    expected = {tokenizer.decode([t]).strip(): 0.0 for t in range(probs.shape[0])}
    for t in range(probs.shape[0]):
        expected[tokenizer.decode([t]).strip()] += float(probs[t])
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    their_texts = Counter("" if t in stop else tokenizer.decode([t]).strip() for t in theirs)
    our_texts = Counter(ours)
    top = sorted(expected, key=expected.get, reverse=True)[:5]
    assert expected[top[0]] > 0.05  # a peaked distribution, so frequencies are informative
    for text in top:
        # 2000 draws: the standard error of a frequency is at most 0.011.
        assert our_texts[text] / n == pytest.approx(expected[text], abs=0.04)
        assert their_texts[text] / n == pytest.approx(expected[text], abs=0.04)


def test_vocab_label_smoothing_equals_explicit_soft_targets():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 11, generator=generator)
    targets = torch.tensor([0, 3, 10, 4, 4])
    keep = torch.tensor([0.9, 0.5, 0.2, 1.0, 0.7])
    soft = ((1 - keep) / 10)[:, None].expand(-1, 11).clone()
    soft[torch.arange(5), targets] = keep
    explicit = -(soft * torch.log_softmax(logits, -1)).sum(-1).mean()
    assert smoothed_vocab_cross_entropy(logits, targets, keep) == pytest.approx(float(explicit))


def _check_question_file(directory: Path, n_samples: int) -> list[dict]:
    rows = [json.loads(line) for line in (directory / "predictions.jsonl").read_text().splitlines()]
    for row in rows:
        assert len(row["samples"]) == len(row["clusters"]) == n_samples
        sizes = Counter(row["clusters"])
        assert row["confidence"] == pytest.approx(max(sizes.values()) / n_samples, abs=1e-6)
        assert row["n_clusters"] == len(sizes)
        assert row["correct"] == grade(row["answer"], row["aliases"])
        # The answer is a sample of the largest cluster.
        largest = {c for c, k in sizes.items() if k == max(sizes.values())}
        assert any(
            s == row["answer"] and c in largest
            for s, c in zip(row["samples"], row["clusters"], strict=True)
        )
    metrics = json.loads((directory / "metrics.json").read_text())["metrics"]
    confidences = [r["confidence"] for r in rows]
    correct = [r["correct"] for r in rows]
    assert metrics["sem_ece"] == pytest.approx(_hand_ece(confidences, correct), abs=1e-6)
    assert metrics["accuracy"] == pytest.approx(sum(correct) / len(rows))
    assert (directory / "reliability.png").stat().st_size > 0
    return rows


@pytest.mark.integration
def test_gen_ood_base_and_calm_end_to_end(tmp_path, compose, gen_ood):
    cfg = compose(gen_ood("method=calm", "method.epochs=1"), tmp_path)
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 4 and 0.0 <= metrics["sem_ece"] <= 1.0
    payload = json.loads((tmp_path / "metrics.json").read_text())
    assert set(payload["comparison"]) == {"base", "calm"}
    assert payload["task"] == "openqa" and payload["sampling"]["n_samples"] == 6
    assert payload["sampling"]["clusterer"] == "EmbeddingClusterer"
    base_rows = _check_question_file(tmp_path / "base", 6)
    calm_rows = _check_question_file(tmp_path, 6)
    assert [r["id"] for r in base_rows] == [r["id"] for r in calm_rows]
    assert any(s for r in base_rows for s in r["samples"])  # real text was sampled
    # CALM's upper level moved the head away from the identity on open-QA answers, and the
    # sampler used that head (it is applied at every sampling step).
    from safetensors.torch import load_file

    head = load_file(tmp_path / "calibration" / "logit_adjustment.safetensors")
    assert (head["scale"] != 1).any() and (head["bias"] != 0).any()


@pytest.mark.integration
def test_gen_ood_sampling_is_reproducible(tmp_path, compose, gen_ood):
    cfg = compose(gen_ood("method=base", "clusterer=exact"), tmp_path / "a")
    run_experiment(cfg)
    cfg = compose(gen_ood("method=base", "evaluation.openqa.confidence=split_half"), tmp_path / "b")
    run_experiment(cfg)
    a = (tmp_path / "a" / "predictions.jsonl").read_text().splitlines()
    b = (tmp_path / "b" / "predictions.jsonl").read_text().splitlines()
    # Same seed, same samples, whatever the clusterer and confidence rule.
    assert [json.loads(x)["samples"] for x in a] == [json.loads(x)["samples"] for x in b]
    sampling = json.loads((tmp_path / "a" / "metrics.json").read_text())["sampling"]
    assert sampling["clusterer"] == "ExactMatchClusterer"
    sampling = json.loads((tmp_path / "b" / "metrics.json").read_text())["sampling"]
    assert sampling["confidence"] == "split_half"


@pytest.mark.integration
@pytest.mark.parametrize("method", ["ls", "reg", "cft", "iterate", "ts"])
def test_gen_ood_baselines_run(tmp_path, method, compose, gen_ood):
    cfg = compose(gen_ood(f"method={method}", "trainer.max_epochs=1"), tmp_path)
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 4 and "sem_ece" in metrics
    payload = json.loads((tmp_path / "metrics.json").read_text())
    assert set(payload["comparison"]) == {"base", method}


@pytest.mark.slow
def test_embedded_model_answers_demo_questions(tmp_path, compose):
    """The real embedded model on a few offline open questions: real answers are sampled,
    clustered with MiniLM and graded, and some sampled answers are right."""
    cfg = compose(
        [
            "method=base",
            "setting=demo_gen_ood",
            "setting.test.limit=8",
            "evaluation.openqa.n_samples=8",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    assert metrics["n"] == 8
    rows = _check_question_file(tmp_path, 8)
    answers = [s for r in rows for s in r["samples"]]
    assert sum(bool(s) for s in answers) > len(answers) // 2  # mostly non-empty text
    assert any(grade(s, r["aliases"]) for r in rows for s in r["samples"])
