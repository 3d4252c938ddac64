"""Vector scaling restricted to the option tokens: a per-token-id scale d_v and bias l_v on a
set O of token ids (identity elsewhere), fitted by the NLL of the option distribution with an
L2 pull toward the identity, exactly as evaluation applies a vector head.

A scored option is a sum over its positions p of s_p, normalised by its length n (the scorer's
`normalize`; 1 for letters): option logit = sum_p s_p / n, softmax over the K options. Each
position keeps the logits z_{p,v} of the ids in O, the target's index in O and (cloze) the
logsumexp r_p of the logits of every id outside O, which the head leaves alone:

    cloze:   s_p = d_t z_{p,t} + l_t - log(exp(r_p) + sum_{v in O} exp(d_v z_{p,v} + l_v))
    letter:  s_p = d_t z_{p,t} + l_t       (the softmax over the K letters normalises)

with t the position's target. That is the vector head's z' = d * z + l over the whole
vocabulary followed by the scorer's own log-softmax, so the installed head scores the
calibration split exactly as the fit saw it. The scorers build the rows: `letter_rows` here
from letter logits, `cloze_rows` (evaluation/cloze.py) from a cloze pass over the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TokenRows:
    """One batch's positions, ready for the fit (float64, CPU)."""

    z: torch.Tensor  # (P, |O|) logits of the ids in O at each position
    rest: torch.Tensor | None  # (P,) logsumexp over the ids outside O; None: no normalisation
    target: torch.Tensor  # (P,) index into O of the token each position scores
    owner: torch.Tensor  # (P,) the (question, option) row a position belongs to: q * K + k
    lengths: torch.Tensor  # (B, K) what each option's summed score is divided by


def concat(rows: list[TokenRows]) -> TokenRows:
    """The batches as one, the owners renumbered."""
    owners, offset = [], 0
    for row in rows:
        owners.append(row.owner + offset)
        offset += row.lengths.numel()
    rests = [row.rest for row in rows]
    return TokenRows(
        z=torch.cat([row.z for row in rows]),
        rest=None if rests[0] is None else torch.cat(rests),
        target=torch.cat([row.target for row in rows]),
        owner=torch.cat(owners),
        lengths=torch.cat([row.lengths for row in rows]),
    )


def letter_rows(logits: torch.Tensor) -> TokenRows:
    """Rows of letter scoring: (B, K) letter logits; O is the K letters, option k's one
    position scores letter k."""
    b, k = logits.shape
    return TokenRows(
        z=logits.double().cpu().repeat_interleave(k, dim=0),
        rest=None,
        target=torch.arange(k).repeat(b),
        owner=torch.arange(b * k),
        lengths=torch.ones(b, k, dtype=torch.float64),
    )


def option_logits(rows: TokenRows, scale: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """(B, K) option logits under the head (scale, bias) on O (differentiable)."""
    adjusted = rows.z * scale + bias
    score = adjusted.gather(1, rows.target[:, None]).squeeze(1)
    if rows.rest is not None:
        score = score - torch.logsumexp(torch.cat([adjusted, rows.rest[:, None]], 1), 1)
    total = torch.zeros(rows.lengths.numel(), dtype=score.dtype).index_add(0, rows.owner, score)
    return total.view(rows.lengths.shape) / rows.lengths


@dataclass
class VectorFit:
    scale: torch.Tensor  # (|O|,) d
    bias: torch.Tensor  # (|O|,) l
    nll_before: float  # identity head
    nll_after: float  # fitted head (NLL only, without the penalty)
    iterations: int
    n: int


def nll(rows: TokenRows, labels: torch.Tensor, scale, bias) -> torch.Tensor:
    logits = option_logits(rows, scale, bias)
    return torch.nn.functional.cross_entropy(logits, labels)


def fit_vector_scaling(
    rows: TokenRows, labels: torch.Tensor, l2: float, max_iter: int = 500
) -> VectorFit:
    """argmin over (d, l) of mean NLL + l2 * (|d - 1|^2 + |l|^2), by torch's L-BFGS with a
    strong-Wolfe line search in float64 (autograd's exact gradients of the per-position
    log-softmax; the problem has 2 |O| parameters and fits in memory)."""
    labels = torch.as_tensor(labels, dtype=torch.long)
    n_ids = rows.z.shape[1]
    scale = torch.ones(n_ids, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(n_ids, dtype=torch.float64, requires_grad=True)
    with torch.no_grad():
        before = float(nll(rows, labels, scale, bias))
    optimizer = torch.optim.LBFGS(
        [scale, bias],
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=1e-10,
        tolerance_change=1e-14,
        history_size=20,
        line_search_fn="strong_wolfe",
    )

    def closure():
        optimizer.zero_grad()
        penalty = ((scale - 1.0) ** 2).sum() + (bias**2).sum()
        loss = nll(rows, labels, scale, bias) + l2 * penalty
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        after = float(nll(rows, labels, scale, bias))
    steps = optimizer.state[scale].get("n_iter", 0)
    return VectorFit(scale.detach(), bias.detach(), before, after, int(steps), int(labels.numel()))
