"""Losses on response positions: the lower level's cross-entropy and the upper level's entropy.

Instruction batches carry labels aligned with `input_ids` (-100 on prompt and padding); the
logit at position t predicts token t + 1, so response positions are where `labels[:, 1:]` is
not -100 (data/collate.py). Only those rows of the (B, L, V) logits are pushed through the
head and the losses, which keeps the vocabulary-wide tensors as small as the response.

An objective reads one of two distributions (its mode): `vocab`, every response token's
next-token distribution, or `options`, the option distribution evaluation scores, which the
MCQA scorer computes from a batch (`training_logits`, evaluation/scorers.py: the option letters
at the answer slot, or option likelihood). `adjusted_predictions` reads either from raw logits
the caller already has; there `options` is the letters (a lower level's answer under letter
scoring; under cloze scoring the answer is its text, `vocab`: the scorer's `answer_is_option`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from calm_lightning.data.collate import response_positions, select_response_logits
from calm_lightning.evaluation.mcqa import answer_slot_rows

VOCAB, OPTIONS = "vocab", "options"
MODES = (VOCAB, OPTIONS)


def mean_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean Shannon entropy (nats) of softmax(logits) over the last dimension, in fp32.

    Written as H = logsumexp(z) - sum(p * z): autograd then keeps one (N, V) tensor (p) for
    the backward instead of two (log p and p) with the textbook -sum(p log p).
    """
    z = logits.float()
    p = torch.softmax(z, dim=-1)
    return (torch.logsumexp(z, dim=-1) - (p * z).sum(-1)).mean()


def cross_entropy(adjusted: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy in fp32."""
    return F.cross_entropy(adjusted.float(), targets)


def objective_count(batch: dict, mode: str) -> int:
    """How many items a mean over this batch's predictions in `mode` averages over: response
    tokens (`vocab`), questions (`options`; a letter- or cloze-format batch has one labels row
    per question). Data parallelism weights each process's mean by it (distributed.GlobalMean)."""
    if mode == VOCAB:
        return int(response_positions(batch["labels"]).sum())
    return int(batch["labels"].shape[0])


def select_predictions(
    raw: torch.Tensor, labels: torch.Tensor, mode: str, option_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of raw logits a training objective scores, and their targets.

    vocab: every response position over the full vocabulary; targets are next-token ids.
    options: the option letters at the answer slot (evaluation/mcqa.py); the caller restricts
    it to `option_ids`, and targets are option indices (which letter the response starts with).
    """
    if mode not in MODES:
        raise ValueError(f"objective mode {mode!r} is not one of {', '.join(MODES)}")
    if mode == VOCAB:
        return select_response_logits(raw, labels)
    return answer_slot_rows(raw, labels, option_ids)


def adjusted_predictions(
    model,
    raw: torch.Tensor,
    labels: torch.Tensor,
    mode: str,
    option_ids: torch.Tensor | None = None,
    head_params: dict[str, torch.Tensor] | None = None,
):
    """`select_predictions` followed by the model's logit adjustment (fp32); with
    `head_params`, the head computed with those tensors in place of its own (a surrogate)."""
    rows, targets = select_predictions(raw, labels, mode, option_ids)
    ids = None if mode == VOCAB else option_ids
    if head_params is not None:
        return torch.func.functional_call(model.head, head_params, (rows, ids)), targets
    return model.adjust(rows, ids), targets
