"""MCQA scoring shared by every method: next-token logits of the option letters at the answer
slot, through the logit-adjustment head, softmaxed over the options; and the same letters at
the answer slot of letter-format training batches (training objectives' option distribution)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from calm_lightning.data.collate import first_response_positions
from calm_lightning.data.prompts import (
    OPTION_LETTERS,
    mcqa_user_text,
    render_conversation,
    render_prompt,
)
from calm_lightning.data.records import MCQARecord
from calm_lightning.data.tokens import split_joint, text_ids_after
from calm_lightning.errors import ConfigError

log = logging.getLogger(__name__)
STYLES = ("auto", "bare", "space")
SPELLINGS = (("bare", ""), ("space", " "))


@dataclass(frozen=True)
class OptionTokens:
    """Token ids of the option letters, and which spelling ("A" or " A") they are."""

    style: str
    ids: tuple[int, ...]
    letters: str

    def tensor(self, device=None) -> torch.Tensor:
        return torch.tensor(self.ids, dtype=torch.long, device=device)


def _placeholder_question(n_options: int) -> str:
    # Every MCQA prompt ends the same way (the template's assistant turn), so any question
    # gives the context the letters are read in.
    return mcqa_user_text(MCQARecord("letters", "?", tuple("?" * n_options), 0))


def answer_slot_prompt(tokenizer, n_options: int = 4) -> str:
    """A rendered MCQA prompt, ending at the answer slot: where the letters are read."""
    return render_prompt(tokenizer, _placeholder_question(n_options))


def _in_context(tokenizer, prompt: str, text: str) -> str:
    ids = text_ids_after(tokenizer, prompt, text)
    if ids is None:
        return f"{text!r}: merges with the prompt's end"
    return f"{text!r}: {tokenizer.convert_ids_to_tokens(ids)}"


def option_token_candidates(
    tokenizer, n_options: int = 4, prompt: str | None = None
) -> dict[str, OptionTokens]:
    """The spellings of the letters that are one token each where they are read: bare "A" and
    space-prefixed " A", each the id the joint encoding of the prompt (`prompt`, default
    `answer_slot_prompt`) + the letter adds after the prompt. A letter encoded alone can be
    another token (SentencePiece spells "A" alone `▁A`, after a newline `A`)."""
    letters = OPTION_LETTERS[:n_options]
    prompt = answer_slot_prompt(tokenizer, n_options) if prompt is None else prompt
    found = {}
    for style, prefix in SPELLINGS:
        ids = [text_ids_after(tokenizer, prompt, prefix + letter) for letter in letters]
        # Only single-token spellings are what a model can emit in one step.
        if all(i is not None and len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(ids):
            found[style] = OptionTokens(style, tuple(i[0] for i in ids), letters)
    if not found:
        spelled = "; ".join(
            _in_context(tokenizer, prompt, prefix + letter)
            for _, prefix in SPELLINGS
            for letter in letters
        )
        raise ConfigError(
            f"the option letters {letters!r} are not one token each after the MCQA prompt "
            f"(neither bare nor space-prefixed): {spelled}. Letter scoring reads one token per "
            "option; use evaluation.scoring=cloze for this tokenizer."
        )
    # Identical id sets (some tokenizers ignore a leading space) are one candidate.
    if "bare" in found and "space" in found and found["bare"].ids == found["space"].ids:
        del found["space"]
    return found


def training_letter_ids(tokenizer, n_options: int = 4) -> OptionTokens:
    """The letters' ids as letter-format training targets spell them: the first response
    token of each letter's rendered training conversation, in the joint encoding of prompt +
    response the training collator uses (data/collate.py). A letter that is not one token
    there (merged with the prompt or with what follows it) is refused."""
    letters = OPTION_LETTERS[:n_options]
    ids = []
    for letter in letters:
        prompt, response = render_conversation(tokenizer, _placeholder_question(n_options), letter)
        spelled = response[: response.index(letter) + 1]  # up to the letter (" A" in plain)
        letter_ids = text_ids_after(tokenizer, prompt, spelled)
        _, response_ids = split_joint(tokenizer, prompt, response)
        if letter_ids is None or len(letter_ids) != 1 or response_ids[:1] != letter_ids:
            raise ConfigError(
                f"the training answer {response!r} does not start with the letter as one token "
                f"after the prompt ({_in_context(tokenizer, prompt, spelled)}, the response: "
                f"{tokenizer.convert_ids_to_tokens(response_ids)}); letter-format training "
                "reads one token per letter: use evaluation.scoring=cloze for this tokenizer."
            )
        ids.append(letter_ids[0])
    if len(set(ids)) != len(ids):
        raise ConfigError(f"the training letters {letters!r} share token ids {ids}")
    return OptionTokens("space" if spelled.startswith(" ") else "bare", tuple(ids), letters)


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
            raise ConfigError(
                f"evaluation.option_tokens={style}: the option letters have no single-token "
                f"'{style}' spelling after the MCQA prompt here; use one of "
                f"{', '.join(['auto', *candidates])}"
            )
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
