"""The cached sampler on the tiny model: seeded, greedy equals `generate`, batched equals
one question at a time."""

from __future__ import annotations

import pytest
import torch

from calm_lightning.data.prompts import render_prompt
from calm_lightning.evaluation.sampling import sample_answers
from calm_lightning.models.calibrated_lm import CalibratedLM

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "2 + 2 = ?"]


@pytest.fixture(scope="module")
def flat_tiny():
    """The tiny model without the embedding scale-up: near-uniform next-token distributions,
    so samples differ and answers are not cut at once by a newline."""
    from calm_lightning.models.loading import load_language_model

    return load_language_model({"name": "tiny", "source": "tiny", "tiny": {"embedding_scale": 1.0}})


def _prompts(tokenizer):
    return [render_prompt(tokenizer, q) for q in QUESTIONS]


def test_sampling_is_seeded(flat_tiny):
    model = CalibratedLM(flat_tiny.model).eval()
    tokenizer = flat_tiny.tokenizer
    prompts = _prompts(tokenizer)
    a = sample_answers(model, tokenizer, prompts, n=5, max_new_tokens=6, seed=3)
    b = sample_answers(model, tokenizer, prompts, n=5, max_new_tokens=6, seed=3)
    c = sample_answers(model, tokenizer, prompts, n=5, max_new_tokens=6, seed=4)
    assert a == b and a != c
    assert len(a) == 3 and all(len(samples) == 5 for samples in a)
    assert all(answer for samples in a for answer in samples)  # non-trivial text
    assert len({answer for answer in a[0]}) > 1  # the n draws differ


def test_greedy_equals_generate_and_batching_does_not_matter(flat_tiny):
    tokenizer, lm = flat_tiny.tokenizer, flat_tiny.model
    model = CalibratedLM(lm).eval()
    # Plain prompts: a random tied-embedding model tends to repeat the prompt's last token,
    # and after a chat template's final newline that would be an empty answer.
    prompts = ["Question: what is two plus two? Answer:", "The primary colours are", "Paris"]
    options = {"n": 2, "max_new_tokens": 8, "temperature": 0, "stop_on_newline": False}
    greedy = sample_answers(model, tokenizer, prompts, batch_size=3, **options)
    one_by_one = sample_answers(model, tokenizer, prompts, batch_size=1, **options)
    assert greedy == one_by_one
    for prompt, samples in zip(prompts, greedy, strict=True):
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = lm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=8,
                pad_token_id=tokenizer.pad_token_id,
            )
        new = out[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in new:
            new = new[: new.index(tokenizer.eos_token_id)]
        expected = tokenizer.decode(new, skip_special_tokens=True).strip()
        assert expected and samples == [expected, expected]
