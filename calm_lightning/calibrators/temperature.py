"""Temperature scaling: one T minimising the NLL of softmax(z / T), fitted with scipy's bounded
scalar minimiser in float64."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import minimize_scalar

log = logging.getLogger(__name__)
BOUNDS = (0.1, 10.0)


@dataclass
class TemperatureFit:
    temperature: float
    nll_before: float  # at T = 1
    nll_after: float
    at_bound: bool
    n: int


def _nll(logits: torch.Tensor, labels: torch.Tensor, temperature: float, chunk: int) -> float:
    total = 0.0
    for start in range(0, logits.shape[0], chunk):
        z = logits[start : start + chunk].double() / temperature
        y = labels[start : start + chunk]
        total += (torch.logsumexp(z, dim=-1) - z.gather(1, y[:, None]).squeeze(1)).sum().item()
    return total / logits.shape[0]


def fit_temperature(
    logits, labels, bounds: tuple[float, float] = BOUNDS, xatol: float = 1e-4, chunk: int = 256
) -> TemperatureFit:
    """T = argmin_T mean NLL(softmax(logits / T), labels) over `bounds` (float64 arithmetic).

    `logits` is (N, K): option logits, or next-token logits over a vocabulary (then chunks of
    `chunk` rows, by default ~4M elements, keep the float64 copies small). Warns when T lands
    on a bound.
    """
    logits = torch.as_tensor(logits)
    labels = torch.as_tensor(labels, dtype=torch.long)
    if logits.ndim != 2 or labels.shape != (logits.shape[0],):
        raise ValueError("fit_temperature needs logits (N, K) and labels (N,)")
    if logits.shape[0] == 0:
        raise ValueError("fit_temperature needs at least one example")
    chunk = chunk or max(1, 2**22 // logits.shape[1])
    result = minimize_scalar(
        lambda t: _nll(logits, labels, float(t), chunk),
        bounds=bounds,
        method="bounded",
        options={"xatol": xatol},
    )
    temperature = float(result.x)
    lo, hi = bounds
    at_bound = bool(np.isclose(temperature, [lo, hi], atol=1e-3).any())
    if at_bound:
        log.warning(
            "temperature %.4f is at the search bound %s: the best T may lie outside",
            temperature,
            bounds,
        )
    return TemperatureFit(
        temperature=temperature,
        nll_before=_nll(logits, labels, 1.0, chunk),
        nll_after=float(result.fun),
        at_bound=at_bound,
        n=int(logits.shape[0]),
    )
