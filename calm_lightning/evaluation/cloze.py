"""Option-likelihood ("cloze") MCQA scoring, the way lm-eval-harness scores multiple choice: the
log-likelihood of each option's text as the continuation of the question prompt, under the
calibrated model (the logit-adjustment head applied to the logits at every continuation
token), combined into a distribution over the K options.

Fast path: each question prompt is encoded once; its KV cache is repeated K times and the K
continuations run against it together (batched across questions, left padding handled with
position ids), instead of K full forwards of prompt + option per question (lm-eval's way,
kept here as `score_cloze_separate` for the benchmark and the tests).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.interpolate import CubicSpline
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

from calm_lightning.calibrators.temperature import BOUNDS, TemperatureFit
from calm_lightning.data.collate import IGNORE_INDEX, pad_left
from calm_lightning.data.prompts import render_conversation
from calm_lightning.evaluation.sampling import _cache_names, prefill_repeated
from calm_lightning.models.calibrated_lm import positions_from_mask

NORMALIZE = ("none", "tokens", "chars")
PROMPTS = ("chat", "plain")


@dataclass(frozen=True)
class ClozeSettings:
    """`normalize`: how an option's summed log-likelihood becomes its logit (none = the sum);
    `prompt`: chat (question as the user turn, option as the start of the assistant turn) or
    plain (`Question: ...\\nAnswer:` then ` <option>`)."""

    normalize: str = "none"
    prompt: str = "chat"

    def __post_init__(self) -> None:
        if self.normalize not in NORMALIZE:
            raise ValueError(f"cloze normalize {self.normalize!r} is not one of {NORMALIZE}")
        if self.prompt not in PROMPTS:
            raise ValueError(f"cloze prompt {self.prompt!r} is not one of {PROMPTS}")


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
    own encoding (so a merge across the boundary stays in the option); a prompt longer than
    `max_length` minus the longest option loses tokens from the left."""
    conts, chars, context_ids = [], [], None
    for option in options:
        context, cont = _render(tokenizer, question, option, prompt)
        ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
        whole = tokenizer(context + cont, add_special_tokens=False)["input_ids"]
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
        context_ids = context_ids[-room:]
    return context_ids, conts, chars


def _continuation_loglik(model, logits: torch.Tensor, targets: torch.Tensor, mask) -> torch.Tensor:
    """Sum over positions of log softmax(head(logits))[target] where mask is 1 (rows (N,))."""
    adjusted = model.adjust(logits)  # fp32, head over the full vocabulary
    logp = torch.log_softmax(adjusted, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return (logp.double() * mask).sum(-1)


def _encode_batch(tokenizer, questions, choices, prompt, max_length):
    encoded = [
        encode_question(tokenizer, q, opts, prompt, max_length)
        for q, opts in zip(questions, choices, strict=True)
    ]
    k = len(choices[0])
    if any(len(opts) != k for opts in choices):
        raise ValueError("cloze scoring needs the same number of options in every question")
    return encoded, k


def _shared_prompt_logits(model, tokenizer, encoded, k: int):
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
    encoded, k = _encode_batch(tokenizer, questions, choices, prompt, max_length)
    logits, cont_ids, cont_mask = _shared_prompt_logits(model, tokenizer, encoded, k)
    loglik = _continuation_loglik(model, logits, cont_ids, cont_mask)
    return _scores(loglik, encoded, k)


@torch.no_grad()
def temperature_terms(
    model,
    tokenizer,
    questions: list[str],
    choices: list,
    scales: torch.Tensor,
    prompt: str = "chat",
    max_length: int | None = None,
) -> tuple[ClozeScores, torch.Tensor]:
    """What a temperature fit needs, on the model's own logits z (no head): with d = 1 / T the
    option log-likelihood is d * sum_t z_t[y_t] - sum_t logsumexp(d * z_t). Returns the scores
    at d = 1 with `loglik` = sum_t z_t[y_t], and the (B, K, G) sums of logsumexp at `scales`."""
    encoded, k = _encode_batch(tokenizer, questions, choices, prompt, max_length)
    logits, cont_ids, cont_mask = _shared_prompt_logits(model, tokenizer, encoded, k)
    logits = logits.float()
    mask = cont_mask.double()
    target = (logits.gather(-1, cont_ids[..., None]).squeeze(-1).double() * mask).sum(-1)
    lse = torch.stack(
        [(torch.logsumexp(logits * float(d), dim=-1).double() * mask).sum(-1) for d in scales],
        dim=-1,
    )
    return _scores(target, encoded, k), lse.cpu().view(len(encoded), k, len(scales))


def _scores(loglik: torch.Tensor, encoded, k: int) -> ClozeScores:
    n_tokens = [len(c) for _, cs, _ in encoded for c in cs]
    n_chars = [n for _, _, ns in encoded for n in ns]
    shape = (len(encoded), k)
    return ClozeScores(
        loglik=loglik.cpu().view(shape),
        n_tokens=torch.tensor(n_tokens, dtype=torch.float64).view(shape),
        n_chars=torch.tensor(n_chars, dtype=torch.float64).view(shape),
    )


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
    encoded, k = _encode_batch(tokenizer, questions, choices, prompt, max_length)
    device = next(model.parameters()).device
    rows = {k_: v.to(device) for k_, v in separate_rows(encoded, tokenizer.pad_token_id).items()}
    return _scores(separate_loglik(model, rows), encoded, k)


def temperature_scales(bounds: tuple[float, float], n: int = 49) -> torch.Tensor:
    """Log-spaced scales d = 1 / T covering the temperature search bounds."""
    lo, hi = bounds
    return torch.logspace(math.log10(1.0 / hi), math.log10(1.0 / lo), n, dtype=torch.float64)


def fit_cloze_temperature(
    scores: ClozeScores,
    lse: torch.Tensor,
    labels: torch.Tensor,
    scales: torch.Tensor,
    normalize: str = "none",
    bounds: tuple[float, float] = BOUNDS,
    xatol: float = 1e-4,
) -> TemperatureFit:
    """T minimising the NLL of the cloze option distribution scored through a scalar head
    d = 1 / T, exactly as evaluation scores it (the head acts on every continuation token's
    logits, not on the summed log-likelihoods). The per-option sums of logsumexp are known at
    the grid `scales` and interpolated in log d by a cubic spline (smooth and convex in d)."""
    spline = CubicSpline(np.log(scales.numpy()), lse.numpy(), axis=-1)
    target = scores.loglik.numpy()
    lengths = {"none": None, "tokens": scores.n_tokens, "chars": scores.n_chars}[normalize]
    lengths = None if lengths is None else lengths.clamp(min=1).numpy()
    y = np.asarray(labels, dtype=np.int64)

    def nll(temperature: float) -> float:
        d = 1.0 / temperature
        logits = d * target - spline(math.log(d))
        if lengths is not None:
            logits = logits / lengths
        logp = logits - logsumexp(logits, axis=1, keepdims=True)
        return float(-logp[np.arange(len(y)), y].mean())

    result = minimize_scalar(nll, bounds=bounds, method="bounded", options={"xatol": xatol})
    temperature = float(result.x)
    at_bound = bool(np.isclose(temperature, list(bounds), atol=1e-3).any())
    return TemperatureFit(
        temperature=temperature,
        nll_before=nll(1.0),
        nll_after=float(result.fun),
        at_bound=at_bound,
        n=len(y),
    )


@dataclass
class ClozeTrainingCollator:
    """MCQA training (or held-out) batches in the cloze format, so training sees the answer the
    way cloze evaluation scores it:

    * `input_ids` / `attention_mask` / `labels`: prompt + the gold option's continuation,
      right-padded, labels -100 except on the continuation tokens (the answer text's
      cross-entropy, an objective's `vocab` mode);
    * `cloze`: `separate_rows` of all K options (an objective's `cloze` mode: the option
      distribution by option likelihood, differentiable);
    * `answers`: the gold option index.

    The prompt loses tokens from the left so prompt + longest option fits `max_length`."""

    tokenizer: object
    prompt: str = "chat"
    max_length: int = 512
    stats: dict = field(default_factory=lambda: {"prompt_truncated": 0})

    def __call__(self, records) -> dict:
        encoded = []
        for r in records:
            ctx, conts, chars = encode_question(self.tokenizer, r.question, r.choices, self.prompt)
            room = max(1, self.max_length - max(len(c) for c in conts))  # as encode_question
            self.stats["prompt_truncated"] += int(len(ctx) > room)
            encoded.append((ctx[-room:], conts, chars))
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
