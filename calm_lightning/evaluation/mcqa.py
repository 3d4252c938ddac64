"""MCQA scoring shared by every method: next-token logits of the option letters at the answer
slot, through the logit-adjustment head, softmaxed over the options; and the same letters at
the answer slot of letter-format training batches (training objectives' option distribution)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from calm_lightning.data.collate import first_response_positions
from calm_lightning.data.prompts import OPTION_LETTERS

log = logging.getLogger(__name__)
STYLES = ("auto", "bare", "space")


@dataclass(frozen=True)
class OptionTokens:
    """Token ids of the option letters, and which spelling ("A" or " A") they are."""

    style: str
    ids: tuple[int, ...]
    letters: str

    def tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.ids, dtype=torch.long, device=device)


def option_token_candidates(tokenizer, n_options: int = 4) -> dict[str, OptionTokens]:
    """The spellings of the letters that are one token each: bare "A" and space-prefixed " A"."""
    letters = OPTION_LETTERS[:n_options]
    found = {}
    for style, prefix in (("bare", ""), ("space", " ")):
        ids = []
        for letter in letters:
            encoded = tokenizer(prefix + letter, add_special_tokens=False)["input_ids"]
            # SentencePiece tokenizers may emit a lone "▁" before a bare letter; keep only
            # single-token spellings, which are what a model can emit in one step.
            if len(encoded) != 1:
                break
            ids.append(encoded[0])
        if len(ids) == n_options and len(set(ids)) == n_options:
            found[style] = OptionTokens(style, tuple(ids), letters)
    if not found:
        raise ValueError(f"no single-token spelling of the option letters {letters!r} exists")
    # Identical id sets (some tokenizers ignore a leading space) are one candidate.
    if "bare" in found and "space" in found and found["bare"].ids == found["space"].ids:
        del found["space"]
    return found


@torch.no_grad()
def option_mass(model, batch: dict, tokens: OptionTokens) -> float:
    """Mean probability the (unadjusted) model puts on these letter tokens at the answer slot."""
    logits = model.raw_logits(batch["input_ids"], batch["attention_mask"], logits_to_keep=1)
    probs = torch.softmax(logits[:, -1].float(), dim=-1)
    return probs[:, tokens.tensor(probs.device)].sum(-1).mean().item()


def choose_option_tokens(
    model, tokenizer, probe_batch: dict | None, style: str = "auto", n_options: int = 4
) -> OptionTokens:
    """Pick the letter spelling: fixed by `style`, or under `auto` the one the model emits.

    `auto` compares the probability mass the model puts on each spelling over a fixed probe
    batch (the first prompts of the test split), so the choice does not depend on batching.
    """
    if style not in STYLES:
        raise ValueError(f"option token style {style!r} is not one of {STYLES}")
    candidates = option_token_candidates(tokenizer, n_options)
    if style != "auto":
        if style not in candidates:
            raise ValueError(f"the letters have no single-token '{style}' spelling here")
        return candidates[style]
    if len(candidates) == 1 or probe_batch is None:
        return next(iter(candidates.values()))
    masses = {name: option_mass(model, probe_batch, tok) for name, tok in candidates.items()}
    chosen = max(masses, key=masses.get)
    log.info(
        "option letter spelling: %s (probability mass %s)",
        chosen,
        {k: round(v, 4) for k, v in masses.items()},
    )
    return candidates[chosen]


def score_options(model, batch: dict, tokens: OptionTokens) -> torch.Tensor:
    """Adjusted fp32 logits (B, K) of the option letters at the last prompt position."""
    logits = model.raw_logits(batch["input_ids"], batch["attention_mask"], logits_to_keep=1)
    return model.adjust(logits[:, -1], tokens.tensor(logits.device))


def answer_slot_rows(
    raw: torch.Tensor, labels: torch.Tensor, option_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """A letter-format training batch's raw (B, V) logits at the answer slot (the position
    that predicts the first response token) and which option each answer's letter is."""
    rows = torch.arange(raw.shape[0], device=raw.device)
    slot = first_response_positions(labels)
    letters = labels[rows, slot + 1]
    match = letters[:, None] == option_ids[None, :]
    if not match.any(dim=1).all():
        raise ValueError("a training answer does not start with one of the option letter tokens")
    return raw[rows, slot], match.float().argmax(dim=1)
