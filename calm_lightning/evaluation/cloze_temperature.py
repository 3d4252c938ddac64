"""Temperature scaling of the cloze option distribution: the terms a fit needs from one pass
over the held-out questions, and the scipy fit of T through the head d = 1 / T, exactly as
cloze evaluation scores (the temperature acts on every continuation token's logits)."""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.interpolate import CubicSpline
from scipy.optimize import minimize_scalar
from scipy.special import logsumexp

from calm_lightning.calibrators.temperature import BOUNDS, TemperatureFit
from calm_lightning.data.cloze_batches import encode_batch
from calm_lightning.evaluation.cloze import ClozeScores, option_scores, shared_prompt_logits


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
    encoded, k = encode_batch(tokenizer, questions, choices, prompt, max_length)
    logits, cont_ids, cont_mask = shared_prompt_logits(model, tokenizer, encoded, k)
    logits = logits.float()
    mask = cont_mask.double()
    target = (logits.gather(-1, cont_ids[..., None]).squeeze(-1).double() * mask).sum(-1)
    lse = torch.stack(
        [(torch.logsumexp(logits * float(d), dim=-1).double() * mask).sum(-1) for d in scales],
        dim=-1,
    )
    return option_scores(target, encoded, k), lse.cpu().view(len(encoded), k, len(scales))


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
