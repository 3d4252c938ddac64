"""MCQA scoring is one interface with two implementations, chosen once from the config."""

from __future__ import annotations

import re
from pathlib import Path

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
    assert isinstance(letter, LetterScorer) and letter.answer_is_option
    assert (letter.option_token_style, letter.probe_size) == ("space", 3)
    assert letter.data_options() == {"mcqa_collator": None}  # MCQA trains on the letter
    cloze = scorer_from_config(
        {"scoring": "cloze", "cloze": {"normalize": "chars", "prompt": "plain"}}
    )
    assert isinstance(cloze, ClozeScorer) and not cloze.answer_is_option
    assert (cloze.normalize, cloze.prompt, cloze.probe_size) == ("chars", "plain", 0)
    collator = cloze.data_options()["mcqa_collator"](tokenizer=None, max_length=64)
    assert (collator.prompt, collator.max_length) == ("plain", 64)
    assert isinstance(scorer_from_config(None), LetterScorer)  # the default
    with pytest.raises(ConfigError, match="evaluation.scoring='both' is not one of letter, cloze"):
        scorer_from_config({"scoring": "both"})


def test_the_cloze_scorer_gives_the_cloze_scores_and_acc_norm(tiny_loaded, tokenizer):
    model = CalibratedLM(tiny_loaded.model)
    batch = {"questions": QUESTIONS, "choices": CHOICES, "labels": torch.tensor([0, 0])}
    scorer = ClozeScorer(normalize="tokens", prompt="plain")
    tokens = scorer.select_option_tokens(model, tokenizer, None)
    logits, chosen = scorer.option_logits(model, tokenizer, batch, tokens)
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
    scorer = LetterScorer(option_tokens="space")
    assert scorer.select_option_tokens(model, tokenizer, batch) == tokens
    logits, side = scorer.option_logits(model, tokenizer, batch, tokens)
    assert side is None and logits.dtype == torch.float64
    # Independently: the last prompt position's logits at the letters' token ids.
    with torch.no_grad():
        out = tiny_loaded.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=(batch["attention_mask"].cumsum(-1) - 1).clamp(min=0),
        ).logits[:, -1]
    assert torch.allclose(logits, out[:, list(tokens.ids)].double(), atol=1e-4)


def test_the_letter_scorer_trains_the_letters_at_the_answer_slot(tiny_loaded, tokenizer):
    from calm_lightning.data.collate import IGNORE_INDEX, InstructionCollator
    from calm_lightning.data.datamodule import as_training_example
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    records = [
        MCQARecord(f"q{i}", q, tuple(c), answer=i + 1, source="t")
        for i, (q, c) in enumerate(zip(QUESTIONS, CHOICES, strict=True))
    ]
    batch = InstructionCollator(tokenizer, 256)([as_training_example(r) for r in records])
    torch.manual_seed(0)
    head = LogitAdjustment(tiny_loaded.model.get_output_embeddings().weight.shape[0], "vector")
    with torch.no_grad():
        head.scale.uniform_(0.5, 1.5)
        head.bias.normal_(0, 0.5)
    model = CalibratedLM(tiny_loaded.model, head)
    scorer = LetterScorer()
    ids = scorer.training_option_ids(tokenizer)
    scored = scorer.training_logits(model, batch, ids, answer_ce=True)
    # Independently: the position before each answer's first token, through the head by hand.
    with torch.no_grad():
        logits = tiny_loaded.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    adjusted = head.scale * logits + head.bias
    first = [int((row != IGNORE_INDEX).nonzero()[0]) for row in batch["labels"]]
    slot = torch.stack([adjusted[i, j - 1, ids] for i, j in enumerate(first)])
    torch.testing.assert_close(scored.logits.detach(), slot, atol=1e-4, rtol=0)
    assert scored.targets.tolist() == [1, 2]  # the answers' letters B and C
    rows, targets = [], []
    for i, labels in enumerate(batch["labels"]):
        for j in (labels != IGNORE_INDEX).nonzero().flatten().tolist():
            rows.append(adjusted[i, j - 1])
            targets.append(labels[j])
    expected = torch.nn.functional.cross_entropy(torch.stack(rows), torch.stack(targets))
    assert scored.answer_ce.item() == pytest.approx(expected.item(), abs=1e-5)
    assert scored.answer_tokens == len(targets)
    assert scorer.training_logits(model, batch, ids).answer_ce is None  # only when asked


# A branch on a scoring or mode name: `x == "cloze"`, `"options" not in modes`,
# `mode in ("options", "cloze")`. Methods and data ask the scorer instead (the objective mode
# `vocab` against the option distribution is a choice of the method, not of the scoring).
NAMES = r"[\"'](?:cloze|options|letter)[\"']"
NAME_BRANCH = re.compile(
    rf"(?:==|!=)\s*{NAMES}|{NAMES}\s*(?:==|!=|not\s+in\b|in\b)|\bin\s*\([^)]*{NAMES}"
)
FLAG = re.compile(r"scoring\s*==|self\.scoring\b|self\.cloze\b|mcqa_format|option_mode")


def _sources(*folders: str) -> list[Path]:
    return [p for f in folders for p in sorted((ROOT / "calm_lightning" / f).rglob("*.py"))]


def test_methods_ask_the_scorer_instead_of_testing_the_flag():
    for path in [*_sources("methods", "calibrators", "exported", "runtime", "data")]:
        text = path.read_text()
        assert not FLAG.search(text), f"{path.relative_to(ROOT)} tests the scoring flag"
    assert not FLAG.search((ROOT / "calm_lightning" / "pipeline.py").read_text())
    for path in _sources("methods", "data"):
        hit = NAME_BRANCH.search(path.read_text())
        assert not hit, f"{path.relative_to(ROOT)} branches on a mode name: {hit.group(0)!r}"


def test_the_name_check_catches_mode_branches():
    for line in ('if mode == "cloze":', "if 'options' not in modes:", 'x in ("options", "cloze")'):
        assert NAME_BRANCH.search(line), line
    for line in ('OneOf(("auto", "vocab", "options"))', 'if mode == "vocab":', '"cloze": rows'):
        assert not NAME_BRANCH.search(line), line
