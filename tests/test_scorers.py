"""MCQA scoring is one interface with two implementations, chosen once from the config."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from calm_lightning.data.records import MCQARecord
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.cloze import score_cloze
from calm_lightning.evaluation.scorers import (
    ClozeScorer,
    LetterScorer,
    scorer_from_config,
)
from calm_lightning.models.calibrated_lm import CalibratedLM

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ["What is 2 + 2?", "Which planet is known as the red planet?"]
CHOICES = [["4", "five", "x", "twenty two"], ["Mars", "Jupiter", "Venus", "no"]]


def test_the_config_chooses_the_scorer_once():
    letter = scorer_from_config({"scoring": "letter", "option_tokens": "space", "probe_size": 3})
    assert isinstance(letter, LetterScorer)
    assert (letter.option_token_style, letter.probe_size, letter.option_mode) == (
        "space",
        3,
        "options",
    )
    assert letter.data_options() == {"mcqa_format": "letter"}
    cloze = scorer_from_config(
        {"scoring": "cloze", "cloze": {"normalize": "chars", "prompt": "plain"}}
    )
    assert isinstance(cloze, ClozeScorer) and cloze.option_mode == "cloze"
    assert (cloze.normalize, cloze.prompt) == ("chars", "plain")
    assert cloze.data_options() == {"mcqa_format": "cloze", "cloze_prompt": "plain"}
    assert isinstance(scorer_from_config(None), LetterScorer)  # the default
    with pytest.raises(ConfigError, match="evaluation.scoring='both' is not one of letter, cloze"):
        scorer_from_config({"scoring": "both"})


def test_the_cloze_scorer_gives_the_cloze_scores_and_acc_norm(tiny_loaded, tokenizer):
    model = CalibratedLM(tiny_loaded.model)
    module = SimpleNamespace(model=model, tokenizer=tokenizer, option_tokens=None, _trainer=None)
    batch = {"questions": QUESTIONS, "choices": CHOICES, "labels": torch.tensor([0, 0])}
    scorer = ClozeScorer(normalize="tokens", prompt="plain")
    logits, chosen = scorer.option_logits(module, batch)
    direct = score_cloze(model, tokenizer, QUESTIONS, CHOICES, "plain")
    assert torch.allclose(logits, direct.loglik / direct.n_tokens, atol=1e-9)
    per_char = direct.loglik / direct.n_chars
    assert torch.equal(chosen, per_char.argmax(-1))
    gold = torch.tensor([0, 1])
    expected = float((per_char.argmax(-1) == gold).double().mean())
    assert scorer.extra_metrics(chosen, gold) == {"acc_norm": expected}


def test_the_letter_scorer_reads_the_letters_at_the_answer_slot(tiny_loaded, tokenizer):
    from calm_lightning.data.collate import MCQACollator
    from calm_lightning.evaluation.mcqa import option_token_candidates

    records = [
        MCQARecord(id=f"q{i}", question=q, choices=list(c), answer=0, source="t")
        for i, (q, c) in enumerate(zip(QUESTIONS, CHOICES, strict=True))
    ]
    batch = MCQACollator(tokenizer, max_length=256)(records)
    model = CalibratedLM(tiny_loaded.model)
    tokens = option_token_candidates(tokenizer)["space"]
    module = SimpleNamespace(model=model, tokenizer=tokenizer, option_tokens=tokens)
    logits, side = LetterScorer().option_logits(module, batch)
    assert side is None and logits.dtype == torch.float64
    # Independently: the last prompt position's logits at the letters' token ids.
    with torch.no_grad():
        out = tiny_loaded.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0),
        ).logits[:, -1]
    assert torch.allclose(logits, out[:, list(tokens.ids)].double(), atol=1e-4)


def test_methods_ask_the_scorer_instead_of_testing_the_flag():
    pattern = re.compile(
        # (an objective's *mode* may be cloze: that is the distribution it reads, not the flag)
        r"scoring\s*==|(?<!mode )==\s*[\"']cloze[\"']|self\.scoring\b|self\.cloze\b"
        r"|mcqa_format\s*=\s*cfg"
    )
    for folder in ("methods", "calibrators", "exported", "runtime"):
        for path in (ROOT / "calm_lightning" / folder).rglob("*.py"):
            text = path.read_text()
            assert not pattern.search(text), f"{path.relative_to(ROOT)} tests the scoring flag"
    assert not pattern.search((ROOT / "calm_lightning" / "pipeline.py").read_text())
