"""Where CALM's head stops on a synthetic temperature problem whose answer scipy gives.

Logits k * z with targets drawn from softmax(z): the training cross-entropy is lowest near
temperature k (scipy's `minimize_scalar` gives the exact optimum of the sample). The adapters
are stood in for by an additive logit offset theta (it cannot undo a temperature); the head is
a scalar. Each outer step is the project's own `bilevel_gradients` + `bome_direction` on a
batch of 64 rows, the head stepped by AdamW or sign descent (AdamW, betas 0) under the demo's
schedule (40 % warmup, cosine to 0). The script prints the final temperature of each switch
combination at several upper LRs and run lengths; `tests/test_calm_stop.py` uses the same
functions.

    python studies/calm_stop_toy.py [--k 4]
"""

from __future__ import annotations

import argparse
import math

import torch
from scipy.optimize import minimize_scalar

from calm_lightning.methods.bome import InnerOptions, bilevel_gradients, bome_direction
from calm_lightning.methods.training import warmup_cosine

PAPER = {"log": False, "joint": False, "per_block": False, "sign": False}
VARIANT = {"log": True, "joint": True, "per_block": True, "sign": True}


def temperature_problem(k=4.0, n=1024, v=20, seed=0):
    """(training logits, targets, held-out logits): k * z, targets ~ softmax(z)."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(n, v, generator=gen) * 2.0
    y = torch.multinomial(torch.softmax(z, -1), 1, generator=gen).squeeze(1)
    heldout = torch.randn(n, v, generator=gen) * 2.0
    return k * z, y, k * heldout


def head_losses(logits, y, heldout, theta, head, log: bool):
    """g (cross-entropy) and f (- entropy) in bilevel_gradients' signature; `head` is s = log d
    (`log`) or d. A surrogate is [theta~] or, under the joint value function, [theta~, head~]."""

    def scale(h):
        return h.exp() if log else h

    def lower(surrogate, track):
        t = theta if surrogate is None else surrogate[0]
        h = head if surrogate is None or len(surrogate) == 1 else surrogate[1]
        return torch.nn.functional.cross_entropy(scale(h) * logits + t, y)

    def upper():
        p = torch.log_softmax(scale(head) * heldout + theta, -1)
        return (p.exp() * p).sum(-1).mean()

    return lower, upper


def ce_optimal_temperature(logits, y) -> float:
    def ce(log_d):
        return float(torch.nn.functional.cross_entropy(math.exp(log_d) * logits, y))

    return math.exp(-minimize_scalar(ce, bounds=(-5, 2), method="bounded").x)


def final_temperature(problem, lr: float, steps: int, switches: dict, eta: float = 0.5) -> float:
    """Train the head `steps` outer steps at peak upper LR `lr`; return 1 / d."""
    logits, y, heldout = problem
    theta = torch.zeros(logits.shape[1], requires_grad=True)
    head = torch.tensor([0.0 if switches["log"] else 1.0], requires_grad=True)
    betas = (0.0, 0.0) if switches["sign"] else (0.9, 0.95)
    opt = torch.optim.AdamW([head], lr=lr, betas=betas, eps=1e-12, weight_decay=0.02)
    schedule = warmup_cosine(steps, round(0.4 * steps), 0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        rows = torch.randint(0, len(y), (64,), generator=gen)
        lower, upper = head_losses(
            logits[rows], y[rows], heldout[rows], theta, head, switches["log"]
        )
        # under the joint value function the head's copy steps at the head's own LR
        inner = InnerOptions(steps=3, lr=(0.05, lr) if switches["joint"] else 0.05,
                             optimizer="adam", joint_value=switches["joint"])  # fmt: skip
        grads = bilevel_gradients([theta], [head], lower, upper, inner)
        blocks = (1, 1) if switches["per_block"] else None
        head.grad = bome_direction(grads.grad_f, grads.grad_q, eta=eta, blocks=blocks).direction[1]
        opt.step()
        sched.step()
    d = head.detach().exp() if switches["log"] else head.detach()
    return 1.0 / float(d) if float(d) > 0 else float("inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=float, default=4.0)
    args = parser.parse_args()
    problem = temperature_problem(args.k)
    print(
        f"k = {args.k:g}: scipy's CE-optimal temperature {ce_optimal_temperature(*problem[:2]):.3f}"
    )
    budgets = [(0.03, 12), (0.1, 12), (0.3, 12), (1.0, 12), (3.0, 12), (0.1, 48), (0.3, 48)]
    print("| switches | " + " | ".join(f"lr {lr:g}, {n} steps" for lr, n in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    rows = {
        "paper": PAPER,
        "variant": VARIANT,
        "variant, head_step adamw": {**VARIANT, "sign": False},
        "variant, one lambda": {**VARIANT, "per_block": False},
        "variant, value lower": {**VARIANT, "joint": False},
        "variant, linear head": {**VARIANT, "log": False},
    }
    for name, switches in rows.items():
        temps = [final_temperature(problem, lr, n, switches) for lr, n in budgets]
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in temps) + " |")


if __name__ == "__main__":
    main()
