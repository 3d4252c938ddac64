"""Batch collation: left-padded MCQA prompts for scoring, right-padded instruction examples with
response-only labels for training, open-ended questions as prompt texts for the sampler.
Padding is per batch, never to a global maximum."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from calm_lightning.data.prompts import (
    instruction_user_text,
    mcqa_user_text,
    openqa_user_text,
    render_conversation,
    render_prompt,
)
from calm_lightning.data.records import InstructionRecord, MCQARecord, OpenQARecord
from calm_lightning.data.tokens import cut_left, encode_prompt, split_joint

log = logging.getLogger(__name__)
IGNORE_INDEX = -100


@dataclass
class MCQACollator:
    """Tokenise MCQA prompts with left padding so every row's last token is the answer slot."""

    tokenizer: object
    max_length: int = 1024
    # Questions whose prompt was cut, by id: a count of questions, however many passes (base
    # row, method row) scored them, so a run that reads its base row reports the same number.
    truncated_ids: set = field(default_factory=set)

    @property
    def truncated(self) -> int:
        return len(self.truncated_ids)

    def prompt_ids(self, record: MCQARecord) -> tuple[list[int], bool]:
        """A question's prompt ids as scored (data/tokens.py: BOS where the model takes one),
        cut from the left to `max_length` (the options and the answer slot are at the end),
        and whether they were cut."""
        ids = encode_prompt(self.tokenizer, render_prompt(self.tokenizer, mcqa_user_text(record)))
        return cut_left(self.tokenizer, ids, self.max_length), len(ids) > self.max_length

    def __call__(self, records: list[MCQARecord]) -> dict:
        rows = []
        for record in records:
            ids, cut = self.prompt_ids(record)
            if cut:
                self.truncated_ids.add(record.id)
            rows.append(ids)
        input_ids, attention_mask = pad_left(rows, self.tokenizer.pad_token_id)
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": torch.tensor([r.answer for r in records], dtype=torch.long),
            "ids": [r.id for r in records],
            "n_options": len(records[0].choices),
            # Raw texts for option-likelihood (cloze) scoring, which builds its own prompts.
            "questions": [r.question for r in records],
            "choices": [list(r.choices) for r in records],
        }


@dataclass
class OpenQACollator:
    """Open-ended questions as rendered prompt texts (the sampler tokenises and pads them)."""

    tokenizer: object
    truncated: int = 0  # prompts are short questions; never cut (kept for the data summary)

    def prompt_ids(self, record: OpenQARecord) -> tuple[list[int], bool]:
        """A question's prompt ids as the sampler encodes them (never cut)."""
        text = render_prompt(self.tokenizer, openqa_user_text(record))
        return encode_prompt(self.tokenizer, text), False

    def __call__(self, records: list[OpenQARecord]) -> dict:
        return {
            "prompts": [render_prompt(self.tokenizer, openqa_user_text(r)) for r in records],
            "ids": [r.id for r in records],
            "questions": [r.question for r in records],
            "answers": [list(r.answers) for r in records],
        }


def pad_left(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists to a (B, L) tensor and its attention mask."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row) :] = 1
    return ids, mask


@dataclass
class InstructionCollator:
    """Tokenise instruction examples; labels are -100 on prompt and padding tokens.

    Over-long examples lose prompt tokens from the left first (the start of the response is
    what the loss needs); only a response longer than `max_length` itself is cut at its end.
    Both are counted in `stats`.
    """

    tokenizer: object
    max_length: int = 512
    stats: dict = field(default_factory=lambda: {"prompt_truncated": 0, "response_truncated": 0})

    def encode(self, record: InstructionRecord) -> tuple[list[int], list[int]]:
        prompt, response = render_conversation(
            self.tokenizer, instruction_user_text(record), record.output
        )
        # The response's ids as they follow the prompt (the MCQA answer letter included: the
        # id letter scoring reads at the answer slot), not the response encoded alone.
        prompt_ids, response_ids = split_joint(self.tokenizer, prompt, response)
        if len(response_ids) >= self.max_length:
            self.stats["response_truncated"] += 1
            response_ids = response_ids[: self.max_length - 1]
        room = self.max_length - len(response_ids)
        if len(prompt_ids) > room:
            self.stats["prompt_truncated"] += 1
            prompt_ids = cut_left(self.tokenizer, prompt_ids, room)
        ids = prompt_ids + response_ids
        labels = [IGNORE_INDEX] * len(prompt_ids) + response_ids
        return ids, labels

    def __call__(self, records: list[InstructionRecord]) -> dict:
        encoded = [self.encode(r) for r in records]
        width = max(len(ids) for ids, _ in encoded)
        pad = self.tokenizer.pad_token_id
        input_ids = torch.full((len(records), width), pad, dtype=torch.long)
        labels = torch.full((len(records), width), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(records), width), dtype=torch.long)
        for i, (ids, lab) in enumerate(encoded):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            labels[i, : len(lab)] = torch.tensor(lab)
            mask[i, : len(ids)] = 1
        return {
            "input_ids": input_ids,
            "attention_mask": mask,
            "labels": labels,
            "ids": [r.id for r in records],
        }


# The label layout of instruction batches: the logit at position t predicts token t + 1, so
# response positions are where `labels[:, 1:]` is not IGNORE_INDEX. Training objectives and
# the scorers' training distributions read batches through these.
def response_positions(labels: torch.Tensor) -> torch.Tensor:
    """Boolean (B, L - 1) mask of positions whose next token is a response token."""
    return labels[:, 1:] != IGNORE_INDEX


def select_response_logits(logits: torch.Tensor, labels: torch.Tensor):
    """(N, V) logits at response positions and their (N,) next-token targets."""
    mask = response_positions(labels)
    if not mask.any():
        raise ValueError("the batch has no response tokens (all labels are -100)")
    return logits[:, :-1][mask], labels[:, 1:][mask]


def first_response_positions(labels: torch.Tensor) -> torch.Tensor:
    """Index (per row) of the position that predicts the first response token (the answer
    letter for MCQA examples)."""
    mask = response_positions(labels)
    if not mask.any(dim=1).all():
        raise ValueError("a row has no response tokens")
    return mask.float().argmax(dim=1)
