"""Option-likelihood ("cloze") MCQA scoring, the way lm-eval-harness scores multiple choice: the
log-likelihood of each option's text as the continuation of the question prompt, under the
calibrated model (the logit-adjustment head applied to the logits at every continuation
token), combined into a distribution over the K options.

Fast path: each question prompt is encoded once; its KV cache is repeated K times and the K
continuations run against it together (batched across questions, left padding handled with
position ids), instead of K full forwards of prompt + option per question (lm-eval's way,
kept here as `score_cloze_separate` for the benchmark and the tests). Training reads the same
distribution with gradients from cloze-format batches (`cloze_predictions`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calm_lightning.calibrators.vector_scaling import TokenRows
from calm_lightning.data.cloze_batches import encode_batch, separate_rows
from calm_lightning.data.collate import pad_left
from calm_lightning.evaluation.sampling import _cache_names, prefill_repeated
from calm_lightning.models.calibrated_lm import positions_from_mask

NORMALIZE = ("none", "tokens", "chars")


@dataclass
class ClozeScores:
    """Per-question option scores (B, K) in float64 on the CPU."""

    loglik: torch.Tensor  # summed log-likelihood of each option's continuation tokens
    n_tokens: torch.Tensor  # continuation length in tokens
    n_chars: torch.Tensor  # option text length in characters (lm-eval's acc_norm)
    FIELDS = ("loglik", "n_tokens", "n_chars")

    def logits(self, normalize: str = "none") -> torch.Tensor:
        """The option logits the softmax is taken over."""
        if normalize == "none":
            return self.loglik
        if normalize == "tokens":
            return self.loglik / self.n_tokens.clamp(min=1)
        if normalize == "chars":
            return self.loglik / self.n_chars.clamp(min=1)
        raise ValueError(f"cloze normalize {normalize!r} is not one of {NORMALIZE}")

    def acc_norm_predictions(self) -> torch.Tensor:
        """lm-eval's acc_norm choice: argmax of the log-likelihood per character."""
        return self.logits("chars").argmax(-1)


def _continuation_loglik(model, logits: torch.Tensor, targets: torch.Tensor, mask) -> torch.Tensor:
    """Sum over positions of log softmax(head(logits))[target] where mask is 1 (rows (N,))."""
    adjusted = model.adjust(logits)  # fp32, head over the full vocabulary
    logp = torch.log_softmax(adjusted, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return (logp.double() * mask).sum(-1)


def shared_prompt_logits(model, tokenizer, encoded, k: int):
    """Raw logits (B*K, C, V) predicting each continuation token, its targets and mask, with
    each prompt encoded once and its KV cache repeated for its K options."""
    device = next(model.parameters()).device
    ids, mask = pad_left([ctx for ctx, _, _ in encoded], tokenizer.pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    cache_kwarg, _ = _cache_names(model.lm)
    last, cache = prefill_repeated(model.lm, ids, mask, k)
    first = last[:, None]  # predicts each option's 1st token
    conts = [c for _, cs, _ in encoded for c in cs]
    width = max(len(c) for c in conts)
    cont_ids = torch.full((len(conts), width), tokenizer.pad_token_id, dtype=torch.long)
    cont_mask = torch.zeros((len(conts), width), dtype=torch.long)
    for i, c in enumerate(conts):  # right padding: real tokens never attend to it
        cont_ids[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        cont_mask[i, : len(c)] = 1
    cont_ids, cont_mask = cont_ids.to(device), cont_mask.to(device)
    full_mask = torch.cat([mask.repeat_interleave(k, dim=0), cont_mask], dim=1)
    logits = first
    if width > 1:
        step = model.lm(
            input_ids=cont_ids[:, :-1],
            attention_mask=full_mask[:, :-1],
            position_ids=positions_from_mask(full_mask)[:, ids.shape[1] : -1],
            use_cache=True,
            **{cache_kwarg: cache},
        )
        logits = torch.cat([first, step.logits], dim=1)
    return logits, cont_ids, cont_mask


@torch.no_grad()
def score_cloze(
    model,
    tokenizer,
    questions: list[str],
    choices: list,
    prompt: str = "chat",
    max_length: int | None = None,
) -> ClozeScores:
    """Shared-prompt scores: each prompt encoded once, its KV cache reused by its K options."""
    encoded, k = encode_batch(tokenizer, questions, choices, prompt, max_length)
    logits, cont_ids, cont_mask = shared_prompt_logits(model, tokenizer, encoded, k)
    loglik = _continuation_loglik(model, logits, cont_ids, cont_mask)
    return option_scores(loglik, encoded, k)


@torch.no_grad()
def cloze_rows(
    model,
    tokenizer,
    questions: list[str],
    choices: list,
    token_ids: torch.Tensor,
    prompt: str = "chat",
    max_length: int | None = None,
    normalize: str = "none",
) -> TokenRows:
    """Rows of cloze scoring on the model's own logits (head off): every continuation
    position, with O = `token_ids` (which must hold every continuation token)."""
    encoded, k = encode_batch(tokenizer, questions, choices, prompt, max_length)
    logits, cont_ids, cont_mask = shared_prompt_logits(model, tokenizer, encoded, k)
    keep = cont_mask.bool()
    flat = logits.float()[keep]  # (P, V), positions in (row, position) order
    targets = cont_ids[keep]
    ids = token_ids.to(flat.device)
    index = torch.full((flat.shape[-1],), -1, dtype=torch.long, device=flat.device)
    index[ids] = torch.arange(len(ids), device=flat.device)
    target = index[targets]
    if bool((target < 0).any()):
        raise ValueError("cloze_rows: a continuation token is not among the head's token ids")
    outside = flat.index_fill(-1, ids, float("-inf"))
    owner = torch.arange(keep.shape[0], device=keep.device)[:, None].expand_as(keep)[keep]
    n_tokens = keep.sum(-1).double().cpu().view(len(encoded), k)
    n_chars = torch.tensor([n for _, _, ns in encoded for n in ns], dtype=torch.float64)
    lengths = {
        "none": torch.ones_like(n_tokens),
        "tokens": n_tokens,
        "chars": n_chars.view(len(encoded), k),
    }[normalize]
    return TokenRows(
        z=flat.index_select(-1, ids).double().cpu(),
        rest=torch.logsumexp(outside, dim=-1).double().cpu(),
        target=target.cpu(),
        owner=owner.cpu(),
        lengths=lengths.clamp(min=1),
    )


def option_scores(loglik: torch.Tensor, encoded, k: int) -> ClozeScores:
    n_tokens = [len(c) for _, cs, _ in encoded for c in cs]
    n_chars = [n for _, _, ns in encoded for n in ns]
    shape = (len(encoded), k)
    return ClozeScores(
        loglik=loglik.cpu().view(shape),
        n_tokens=torch.tensor(n_tokens, dtype=torch.float64).view(shape),
        n_chars=torch.tensor(n_chars, dtype=torch.float64).view(shape),
    )


def separate_loglik(model, rows: dict[str, torch.Tensor], params=None) -> torch.Tensor:
    """(B * K,) summed continuation log-likelihoods of `separate_rows` output under the
    calibrated model; differentiable (training objectives use it), `params` as in
    `CalibratedLM.raw_logits`."""
    width = rows["targets"].shape[1]
    logits = model.raw_logits(
        rows["input_ids"], rows["attention_mask"], logits_to_keep=width + 1, params=params
    )[:, :-1]
    return _continuation_loglik(model, logits, rows["targets"], rows["target_mask"].double())


@torch.no_grad()
def score_cloze_separate(
    model,
    tokenizer,
    questions: list[str],
    choices: list,
    prompt: str = "chat",
    max_length: int | None = None,
) -> ClozeScores:
    """lm-eval's way: one full forward of prompt + option per option (all rows of the batch in
    one left-padded forward), logits kept only for the continuation positions."""
    encoded, k = encode_batch(tokenizer, questions, choices, prompt, max_length)
    device = next(model.parameters()).device
    rows = {k_: v.to(device) for k_, v in separate_rows(encoded, tokenizer.pad_token_id).items()}
    return option_scores(separate_loglik(model, rows), encoded, k)


@dataclass
class ClozePredictions:
    """A cloze-format MCQA training batch scored by option likelihood (differentiable)."""

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
