"""Option-likelihood ("cloze") MCQA batches: how a question and its options become token ids
(the prompt, each option's continuation, as lm-eval-harness encodes them), the one-row-per-
option layout, and the training collator that feeds cloze-format MCQA to training. Scoring
them is evaluation/cloze.py's job."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from calm_lightning.data.collate import IGNORE_INDEX, pad_left
from calm_lightning.data.prompts import render_conversation
from calm_lightning.data.records import MCQARecord
from calm_lightning.data.tokens import cut_left, encode_prompt

PROMPTS = ("chat", "plain")


def _render(tokenizer, question: str, option: str, prompt: str) -> tuple[str, str]:
    if prompt == "chat":
        full_prompt, response = render_conversation(tokenizer, question, option)
        # The option text is the start of the assistant turn, without the end-of-turn marker.
        at = response.find(option)
        return full_prompt + (response[:at] if at > 0 else ""), option
    return f"Question: {question}\nAnswer:", f" {option}"


def encode_question(
    tokenizer, question: str, options, prompt: str = "chat", max_length: int | None = None
) -> tuple[list[int], list[list[int]], list[int]]:
    """(prompt ids, continuation ids per option, option lengths in characters).

    As lm-eval does, the continuation is what encoding prompt + option adds after the prompt's
    own encoding (so a merge across the boundary stays in the option); the prompt starts with
    the BOS id where the model takes one (data/tokens.py), and a prompt longer than
    `max_length` minus the longest option loses tokens from the left, BOS kept."""
    conts, chars, context_ids = [], [], None
    for option in options:
        context, cont = _render(tokenizer, question, option, prompt)
        ctx = encode_prompt(tokenizer, context)
        whole = encode_prompt(tokenizer, context + cont)
        if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
            ids = whole[len(ctx) :]
        else:
            ids = tokenizer(cont, add_special_tokens=False)["input_ids"]
        if context_ids is None:
            context_ids = ctx
        conts.append(ids)
        # lm-eval's acc_norm divides by the length of the choice text, not of the
        # continuation string (which has a leading space in the plain prompt).
        chars.append(len(option))
    if max_length is not None:
        room = max(1, max_length - max(len(c) for c in conts))
        context_ids = cut_left(tokenizer, context_ids, room)
    return context_ids, conts, chars


def option_text_ids(tokenizer, records, prompt: str = "chat", special: bool = True) -> list[int]:
    """Every token id of every option text of the MCQA `records` (other records skipped), as
    `encode_question` encodes each option after its question: sorted; `special=False` leaves
    the tokenizer's special tokens out."""
    ids: set[int] = set()
    for record in records:
        if isinstance(record, MCQARecord):
            _, conts, _ = encode_question(tokenizer, record.question, record.choices, prompt)
            ids.update(t for cont in conts for t in cont)
    if not special:
        ids -= set(getattr(tokenizer, "all_special_ids", []) or [])
    return sorted(ids)


def encode_batch(tokenizer, questions, choices, prompt, max_length):
    encoded = [
        encode_question(tokenizer, q, opts, prompt, max_length)
        for q, opts in zip(questions, choices, strict=True)
    ]
    k = len(choices[0])
    if any(len(opts) != k for opts in choices):
        raise ValueError("cloze scoring needs the same number of options in every question")
    return encoded, k


def separate_rows(encoded, pad_id: int) -> dict[str, torch.Tensor]:
    """lm-eval's layout of a batch: one left-padded row of prompt + option per option (B * K
    rows), and each row's continuation targets right-aligned with their mask (continuations
    end every row under left padding)."""
    rows = [ctx + c for ctx, cs, _ in encoded for c in cs]
    conts = [c for _, cs, _ in encoded for c in cs]
    width = max(len(c) for c in conts)
    ids, mask = pad_left(rows, pad_id)
    targets = torch.full((len(rows), width), pad_id, dtype=torch.long)
    cmask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, c in enumerate(conts):
        targets[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        cmask[i, width - len(c) :] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "targets": targets,
        "target_mask": cmask,
        "n_tokens": torch.tensor([len(c) for c in conts], dtype=torch.float64),
        "n_chars": torch.tensor([n for _, _, ns in encoded for n in ns], dtype=torch.float64),
    }


@dataclass
class ClozeTrainingCollator:
    """MCQA training (or held-out) batches in the cloze format, so training sees the answer the
    way cloze evaluation scores it:

    * `input_ids` / `attention_mask` / `labels`: prompt + the gold option's continuation,
      right-padded, labels -100 except on the continuation tokens (the answer text's
      cross-entropy, an objective's `vocab` mode);
    * `cloze`: `separate_rows` of all K options (an objective's `options` mode under cloze
      scoring: the option distribution by option likelihood, differentiable);
    * `answers`: the gold option index.

    The prompt loses tokens from the left so prompt + longest option fits `max_length`."""

    tokenizer: object
    prompt: str = "chat"
    max_length: int = 512
    stats: dict = field(default_factory=lambda: {"prompt_truncated": 0})
    # Where the data summary (metrics.json) keeps `stats`.
    summary_key: ClassVar[str] = "cloze_train_truncation"

    def __call__(self, records) -> dict:
        encoded = []
        for r in records:
            ctx, conts, chars = encode_question(self.tokenizer, r.question, r.choices, self.prompt)
            room = max(1, self.max_length - max(len(c) for c in conts))  # as encode_question
            self.stats["prompt_truncated"] += int(len(ctx) > room)
            encoded.append((cut_left(self.tokenizer, ctx, room), conts, chars))
        k = len(records[0].choices)
        if any(len(r.choices) != k for r in records):
            raise ValueError("cloze training needs the same number of options in every question")
        answers = [r.answer for r in records]
        gold = [(ctx, conts[a]) for (ctx, conts, _), a in zip(encoded, answers, strict=True)]
        width = max(len(ctx) + len(cont) for ctx, cont in gold)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(records), width), pad, dtype=torch.long)
        labels = torch.full((len(records), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(records), width), dtype=torch.long)
        for i, (ctx, cont) in enumerate(gold):
            n = len(ctx) + len(cont)
            input_ids[i, :n] = torch.tensor(ctx + cont, dtype=torch.long)
            labels[i, len(ctx) : n] = torch.tensor(cont, dtype=torch.long)
            mask[i, :n] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "labels": labels,
            "ids": [r.id for r in records],
            "answers": torch.tensor(answers, dtype=torch.long),
            "cloze": separate_rows(encoded, pad),
        }
