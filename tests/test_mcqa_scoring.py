"""MCQA scoring: the right option tokens, and batched (left-padded) scoring equal to one by one,
checked against a direct forward of the unpadded prompt."""

from __future__ import annotations

import pytest
import torch

from calm_lightning.data.collate import MCQACollator
from calm_lightning.data.prompts import mcqa_user_text, render_prompt
from calm_lightning.data.records import MCQARecord
from calm_lightning.evaluation.mcqa import (
    OptionTokens,
    choose_option_tokens,
    option_token_candidates,
    score_options,
)
from calm_lightning.models.calibrated_lm import CalibratedLM, positions_from_mask
from calm_lightning.models.logit_adjustment import LogitAdjustment

RECORDS = [
    MCQARecord("q1", "What is 2 + 2?", ("3", "4", "5", "22"), 1),
    MCQARecord(
        "q2",
        "Which planet is known as the red planet, seen from Earth at night?",
        ("Venus", "Mars", "Jupiter", "Saturn"),
        1,
    ),
    MCQARecord("q3", "Symbol of iron?", ("Ir", "In", "Fe", "I"), 2),
    MCQARecord(
        "q4",
        "A very long question " + "with many words " * 12 + "ending here?",
        ("first option", "second", "third option text", "fourth"),
        3,
    ),
    MCQARecord("q5", "Capital of Peru?", ("Lima", "Quito", "La Paz", "Bogota"), 0),
]


def test_candidates_are_the_letter_tokens(tokenizer):
    candidates = option_token_candidates(tokenizer)
    # Independent: look the tokens up by their vocabulary strings (GPT-2 style "Ġ" = space).
    assert candidates["bare"].ids == tuple(tokenizer.convert_tokens_to_ids(list("ABCD")))
    assert candidates["space"].ids == tuple(
        tokenizer.convert_tokens_to_ids([f"\u0120{c}" for c in "ABCD"])
    )


def test_prompt_ends_at_the_answer_slot(tokenizer):
    prompt = render_prompt(tokenizer, mcqa_user_text(RECORDS[0]))
    assert prompt.endswith("<|im_start|>assistant\n")
    assert "A. 3\nB. 4\nC. 5\nD. 22" in prompt
    # Following the prompt, the tokenizer spells the letter as the bare token.
    with_answer = tokenizer(prompt + "B", add_special_tokens=False)["input_ids"]
    assert with_answer[-1] == option_token_candidates(tokenizer)["bare"].ids[1]


class _FixedLogits(torch.nn.Module):
    """A stand-in model whose next-token distribution favours the given token ids."""

    def __init__(self, vocab: int, favoured: tuple[int, ...]) -> None:
        super().__init__()
        self.logits = torch.zeros(vocab)
        self.logits[list(favoured)] = 8.0

    def raw_logits(self, input_ids, attention_mask, logits_to_keep=0):
        return self.logits.expand(input_ids.shape[0], 1, -1)


@pytest.mark.parametrize("favoured", ["bare", "space"])
def test_auto_picks_the_spelling_the_model_emits(tokenizer, favoured):
    candidates = option_token_candidates(tokenizer)
    model = _FixedLogits(len(tokenizer), candidates[favoured].ids)
    batch = MCQACollator(tokenizer)(RECORDS[:2])
    chosen = choose_option_tokens(model, tokenizer, batch, "auto")
    assert chosen.style == favoured
    assert choose_option_tokens(model, tokenizer, batch, "space").style == "space"


def _direct_option_logits(lm, tokenizer, record, tokens: OptionTokens) -> torch.Tensor:
    """Independent path: the HF model on the unpadded prompt, default positions."""
    ids = tokenizer(
        render_prompt(tokenizer, mcqa_user_text(record)),
        add_special_tokens=False,
        return_tensors="pt",
    )["input_ids"]
    with torch.no_grad():
        logits = lm(input_ids=ids).logits[0, -1]
    return logits[list(tokens.ids)]


def test_batched_equals_one_by_one_and_direct_forward(tiny_loaded):
    lm, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    model = CalibratedLM(lm).eval()
    tokens = option_token_candidates(tokenizer)["bare"]
    collate = MCQACollator(tokenizer)
    with torch.no_grad():
        batched = score_options(model, collate(RECORDS), tokens)
        single = torch.cat([score_options(model, collate([r]), tokens) for r in RECORDS])
    direct = torch.stack([_direct_option_logits(lm, tokenizer, r, tokens) for r in RECORDS])
    torch.testing.assert_close(batched, single, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched, direct, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(batched.softmax(-1), direct.softmax(-1), atol=1e-5, rtol=1e-4)


def test_positions_ignore_left_padding():
    """RoPE is relative, so in fp32 a constant shift barely shows; in bf16 it moves option
    probabilities by up to 0.04 (docs/platform.md). Positions must restart at each row's
    first real token."""
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 3, 4], [0, 0, 0, 0, 0]])
    assert torch.equal(positions_from_mask(mask), expected)


def test_head_is_applied_when_scoring(tiny_loaded):
    lm, tokenizer = tiny_loaded.model, tiny_loaded.tokenizer
    tokens = option_token_candidates(tokenizer)["bare"]
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0], kind="scalar")
    with torch.no_grad():
        head.scale.fill_(0.5)
    batch = MCQACollator(tokenizer)(RECORDS[:3])
    with torch.no_grad():
        plain = score_options(CalibratedLM(lm).eval(), batch, tokens)
        scaled = score_options(CalibratedLM(lm, head).eval(), batch, tokens)
    torch.testing.assert_close(scaled, plain * 0.5)
