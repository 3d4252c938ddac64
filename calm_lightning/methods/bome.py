"""The BOME joint update direction, as a pure function of two gradient lists.

    lambda = max(0, eta - <grad_f, grad_q> / (||grad_q||^2 + eps))
    d      = grad_f + lambda * grad_q

grad_f is the upper objective's gradient (negative entropy), grad_q the residual's
(q = g(alpha, theta) - g(alpha, stopgrad theta~)). Both lists cover the same parameters, all
blocks (adapter and head) flattened into one vector: dot products and norms are sums over
tensors, accumulated in fp32 whatever the parameters' dtype.

With `blocks` (e.g. the adapters' tensors, then the head's) one lambda is computed per block
from that block's slices alone, so a small block's constraint is not outvoted by a large
one's dot product (a departure from the paper's single lambda; docs/calm.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class BomeDirection:
    """The joint direction (one tensor per parameter) and the scalars that made it."""

    direction: list[torch.Tensor]
    lam: float  # the first block's lambda (the only one without `blocks`)
    dot: float
    grad_f_norm: float
    grad_q_norm: float
    lambdas: tuple[float, ...] = ()  # one per block


def _fp32_sum(parts) -> torch.Tensor:
    total = None
    for part in parts:
        total = part if total is None else total + part
    return total if total is not None else torch.zeros((), dtype=torch.float32)


def bome_direction(
    grad_f: Sequence[torch.Tensor | None],
    grad_q: Sequence[torch.Tensor | None],
    eta: float = 0.5,
    eps: float = 1e-8,
    blocks: Sequence[int] | None = None,
) -> BomeDirection:
    """Combine the two gradients; a None entry (parameter unreached) counts as zeros.

    `blocks`: consecutive block sizes (number of tensors) summing to the list length; None is
    one block over everything (the paper's lambda)."""
    if len(grad_f) != len(grad_q):
        raise ValueError(f"gradient lists differ in length: {len(grad_f)} vs {len(grad_q)}")
    pairs = []
    for f, q in zip(grad_f, grad_q, strict=True):
        if f is None and q is None:
            raise ValueError("a parameter has neither an upper nor a residual gradient")
        f = torch.zeros_like(q) if f is None else f
        q = torch.zeros_like(f) if q is None else q
        if f.shape != q.shape:
            raise ValueError(f"gradient shapes differ: {tuple(f.shape)} vs {tuple(q.shape)}")
        pairs.append((f, q))
    blocks = [len(pairs)] if blocks is None else [int(b) for b in blocks]
    if sum(blocks) != len(pairs) or any(b < 1 for b in blocks):
        raise ValueError(f"blocks {blocks} do not partition {len(pairs)} tensors")
    direction, lambdas, start = [], [], 0
    dot_all = f_all = q_all = 0.0
    for size in blocks:
        part = pairs[start : start + size]
        start += size
        dot = _fp32_sum((f.float() * q.float()).sum() for f, q in part)
        q_sq = _fp32_sum(q.float().pow(2).sum() for _, q in part)
        f_sq = _fp32_sum(f.float().pow(2).sum() for f, _ in part)
        lam = torch.clamp(eta - dot / (q_sq + eps), min=0.0)
        direction += [(f.float() + lam * q.float()).to(f.dtype) for f, q in part]
        lambdas.append(float(lam))
        dot_all, f_all, q_all = dot_all + float(dot), f_all + float(f_sq), q_all + float(q_sq)
    return BomeDirection(
        direction=direction,
        lam=lambdas[0],
        dot=dot_all,
        grad_f_norm=math.sqrt(f_all),
        grad_q_norm=math.sqrt(q_all),
        lambdas=tuple(lambdas),
    )
