"""Losses on response positions: the lower level's cross-entropy and the upper level's entropy.

Instruction batches carry labels aligned with `input_ids` (-100 on prompt and padding); the
logit at position t predicts token t + 1, so response positions are where `labels[:, 1:]` is
not -100. Only those rows of the (B, L, V) logits are pushed through the head and the losses,
which keeps the vocabulary-wide tensors as small as the response.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from calm_lightning.data.collate import IGNORE_INDEX
from calm_lightning.evaluation.cloze import separate_loglik


def response_positions(labels: torch.Tensor) -> torch.Tensor:
    """Boolean (B, L - 1) mask of positions whose next token is a response token."""
    return labels[:, 1:] != IGNORE_INDEX


def select_response_logits(logits: torch.Tensor, labels: torch.Tensor):
    """(N, V) logits at response positions and their (N,) next-token targets."""
    mask = response_positions(labels)
    if not mask.any():
        raise ValueError("the batch has no response tokens (all labels are -100)")
    return logits[:, :-1][mask], labels[:, 1:][mask]


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


def first_response_positions(labels: torch.Tensor) -> torch.Tensor:
    """Index (per row) of the position that predicts the first response token (the answer
    letter for MCQA examples)."""
    mask = response_positions(labels)
    if not mask.any(dim=1).all():
        raise ValueError("a row has no response tokens")
    return mask.float().argmax(dim=1)


MODES = ("vocab", "options", "cloze")


def objective_count(batch: dict, mode: str) -> int:
    """How many items a mean over this batch's predictions in `mode` averages over: response
    tokens (`vocab`), questions (`options`, `cloze`). Data parallelism weights each process's
    mean by it (distributed.GlobalMean)."""
    if mode == "vocab":
        return int(response_positions(batch["labels"]).sum())
    if mode == "cloze":
        return int(batch["answers"].shape[0])
    return int(batch["labels"].shape[0])


def select_predictions(
    raw: torch.Tensor, labels: torch.Tensor, mode: str, option_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of raw logits a training objective scores, and their targets.

    vocab: every response position over the full vocabulary; targets are next-token ids.
    options: the answer slot (first response position) of MCQA examples; the caller restricts
    it to `option_ids`, and targets are option indices (which letter the response starts with).
    """
    if mode == "vocab":
        return select_response_logits(raw, labels)
    if mode != "options":
        raise ValueError(f"objective mode {mode!r} is not one of vocab, options here")
    rows = torch.arange(raw.shape[0], device=raw.device)
    slot = first_response_positions(labels)
    letters = labels[rows, slot + 1]
    match = letters[:, None] == option_ids[None, :]
    if not match.any(dim=1).all():
        raise ValueError("a training answer does not start with one of the option letter tokens")
    return raw[rows, slot], match.float().argmax(dim=1)


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
    ids = option_ids if mode == "options" else None
    if head_params is not None:
        return torch.func.functional_call(model.head, head_params, (rows, ids)), targets
    return model.adjust(rows, ids), targets


@dataclass
class ClozePredictions:
    """A cloze-format MCQA batch scored by option likelihood (differentiable)."""

    logits: torch.Tensor  # (B, K) fp32 option logits (summed log-likelihoods, per `normalize`)
    targets: torch.Tensor  # (B,) gold option index
    answer_ce: torch.Tensor  # token-mean cross-entropy of the gold options' continuation tokens
    answer_tokens: int = 1  # how many tokens answer_ce averages over


def cloze_predictions(model, batch: dict, normalize: str = "none", params=None):
    """The option distribution cloze evaluation scores, with gradients: each option's summed
    log-probability of its continuation under the adjusted model (the head over the full
    vocabulary at every token), from one forward of the batch's B * K prompt + option rows.
    The same forward gives the answer text's cross-entropy (the gold rows' tokens)."""
    if "cloze" not in batch:
        raise ValueError(
            "a cloze objective needs cloze-format MCQA batches (evaluation.scoring=cloze with "
            "MCQA training / held-out data)"
        )
    rows = batch["cloze"]
    answers = batch["answers"]
    b = answers.shape[0]
    loglik = separate_loglik(model, rows, params=params).view(b, -1)
    k = loglik.shape[1]
    gold = loglik[torch.arange(b, device=loglik.device), answers]
    gold_tokens = rows["n_tokens"].view(b, k)[torch.arange(b), answers.cpu()].sum()
    answer_ce = -(gold.sum() / gold_tokens.to(gold.device)).float()
    lengths = {"none": None, "tokens": rows["n_tokens"], "chars": rows["n_chars"]}[normalize]
    logits = loglik if lengths is None else loglik / lengths.clamp(min=1).view(b, k)
    return ClozePredictions(logits.float(), answers, answer_ce, int(gold_tokens))


def predictions(
    model,
    batch: dict,
    mode: str,
    option_ids: torch.Tensor | None = None,
    params=None,
    normalize: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The adjusted logits an objective scores and their targets, whatever the mode: one
    forward of the batch (`vocab`, `options`) or of its cloze rows (`cloze`: (B, K) option
    logits, targets the gold options)."""
    if mode == "cloze":
        scored = cloze_predictions(model, batch, normalize, params)
        return scored.logits, scored.targets
    raw = model.raw_logits(batch["input_ids"], batch["attention_mask"], params=params)
    return adjusted_predictions(model, raw, batch["labels"], mode, option_ids)
