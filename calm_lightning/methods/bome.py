"""First-order BOME for CALM: the surrogate theta~, the two gradients of an outer step and the
joint update direction, independent of what the model is (methods/calm.py supplies the losses).

`bilevel_gradients` gives grad f and grad q over (theta, alpha), theta~ stepped by `InnerStep`
(afresh each outer step, or kept across steps by `PersistentSurrogate`: the amortized
schedule); `bome_direction` combines them:

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from calm_lightning.errors import ConfigError
from calm_lightning.runtime.distributed import GlobalMean

INNER_OPTIMIZERS = ("sgd", "adam")


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


LowerLoss = Callable[[list[torch.Tensor] | None, bool], torch.Tensor]


@dataclass
class BilevelGradients:
    """Both gradients over (theta, alpha), the loss values they came from, and the surrogate."""

    grad_f: list[torch.Tensor | None]
    grad_q: list[torch.Tensor | None]
    g: torch.Tensor  # g(alpha, theta)
    g_surrogate: torch.Tensor  # g(alpha, theta~)
    f: torch.Tensor  # upper objective (negative entropy)
    surrogate: list[torch.Tensor] | None = None  # theta~ (detached), when asked to keep it

    @property
    def q(self) -> torch.Tensor:
        return self.g - self.g_surrogate


def _sub(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return None if b is None else -b
    return a if b is None else a - b


class InnerStep:
    """The surrogate's update rule: `sgd` (t <- t - rho g) or `adam` (bias-corrected Adam, no
    weight decay: each element moves by about rho per step, the scale the outer AdamW moves
    theta by). per_step starts its moments afresh at every outer step; the amortized schedule
    keeps them with its persistent surrogate (reset on re-synchronisation)."""

    def __init__(
        self, kind: str, lr: float | Sequence[float], betas=(0.9, 0.95), eps: float = 1e-8
    ) -> None:
        """`lr`: one step size, or one per tensor (the joint value function steps the head's
        copy at the head's own scale)."""
        if kind not in INNER_OPTIMIZERS:
            choices = ", ".join(INNER_OPTIMIZERS)
            raise ConfigError(f"inner_optimizer={kind!r} is not one of {choices}")
        self.lr = float(lr) if isinstance(lr, int | float) else [float(x) for x in lr]
        self.kind, self.betas, self.eps = kind, tuple(betas), eps
        self.count, self.m, self.v = 0, None, None

    def _lrs(self, n: int) -> list[float]:
        if isinstance(self.lr, float):
            return [self.lr] * n
        if len(self.lr) != n:
            raise ValueError(f"{len(self.lr)} inner step sizes for {n} tensors")
        return self.lr

    def reset(self) -> None:
        self.count, self.m, self.v = 0, None, None

    def state(self) -> dict:
        return {"count": self.count, "m": self.m, "v": self.v}

    def load_state(self, state: dict) -> None:
        self.count, self.m, self.v = int(state["count"]), state["m"], state["v"]

    @torch.no_grad()
    def __call__(self, tensors, gradients) -> list[torch.Tensor]:
        # New tensors every step: the surrogate can never alias the live parameters.
        lrs = self._lrs(len(tensors))
        if self.kind == "sgd":
            return [
                t.detach() - lr * gr if gr is not None else t.detach().clone()
                for t, gr, lr in zip(tensors, gradients, lrs, strict=True)
            ]
        b1, b2 = self.betas
        self.count += 1
        gradients = [
            torch.zeros_like(t) if g is None else g for t, g in zip(tensors, gradients, strict=True)
        ]
        if self.m is None:
            self.m = [torch.zeros_like(g) for g in gradients]
            self.v = [torch.zeros_like(g) for g in gradients]
        out = []
        c1, c2 = 1 - b1**self.count, 1 - b2**self.count
        for i, (t, g) in enumerate(zip(tensors, gradients, strict=True)):
            self.m[i] = b1 * self.m[i] + (1 - b1) * g
            self.v[i] = b2 * self.v[i] + (1 - b2) * g * g
            step = (self.m[i] / c1) / ((self.v[i] / c2).sqrt() + self.eps)
            out.append(t.detach() - lrs[i] * step)
        return out


@dataclass(frozen=True)
class InnerOptions:
    """How the surrogate theta~ steps, in both schedules: the one place its step sizes live.

    `steps`: inner steps per outer step (per_step: T from the live theta; amortized: m steps
    of the persistent theta~). `lr`: rho for every inner tensor, or one per tensor in the
    inner problem's order (the adapters, then under `joint_value` the head's copies, each at
    its own optimizer group's LR). `joint_value` (a departure from the paper): the value
    function minimises over the head too (see `bilevel_gradients`)."""

    steps: int = 1
    lr: float | tuple[float, ...] = 1e-3
    optimizer: str = "sgd"
    betas: tuple[float, float] = (0.9, 0.95)
    joint_value: bool = False

    def step_rule(self) -> InnerStep:
        """A fresh inner update rule (the persistent surrogate keeps its own)."""
        lr = self.lr if isinstance(self.lr, int | float) else list(self.lr)
        return InnerStep(self.optimizer, lr, self.betas)


@dataclass
class _Outer:
    """What every part of one outer step reads: the head, the losses, the options, the mean."""

    alpha: list[torch.Tensor]
    lower_loss: LowerLoss
    inner_losses: list[LowerLoss]
    joint_value: bool
    mean: GlobalMean


@dataclass
class _LivePass:
    """Pass 1 at the live (theta, alpha): g and its two gradient blocks."""

    g: torch.Tensor
    g_theta: list[torch.Tensor | None]
    g_alpha: list[torch.Tensor | None]


def bilevel_gradients(
    theta: Sequence[torch.Tensor],
    alpha: Sequence[torch.Tensor],
    lower_loss: LowerLoss,
    upper_loss: Callable[[], torch.Tensor],
    inner: InnerOptions,
    *,
    inner_losses: Sequence[LowerLoss] | None = None,
    keep_surrogate: bool = False,
    mean: GlobalMean | None = None,
    persistent: PersistentSurrogate | None = None,
) -> BilevelGradients:
    """The gradients of one CALM outer step, independent of what the model is.

    `lower_loss(None, True)` is g(alpha, theta) on the current batch with the live tensors;
    `lower_loss(s, track)` is g(alpha, s) with surrogate tensors `s` standing in for theta
    (`track=False`: the surrogate part needs no graph, only the alpha part does).
    `upper_loss()` is f(alpha, theta). `inner`: how theta~ steps (`InnerOptions`).

    Without `persistent` (the per_step schedule, Algorithm 1) theta~ starts at theta and takes
    one inner step on each of `inner_losses` (None: `inner.steps` steps on `lower_loss`); a
    first step on `lower_loss` itself reuses pass 1's gradient. With `persistent` (the
    amortized schedule) theta~ is that object's stored state, see `PersistentSurrogate`; it
    takes `inner.steps` steps on `lower_loss` per call, by its own rule (built from the same
    options: CALM makes both from one `InnerOptions`). The residual is always measured on the
    current batch: q = g(alpha, theta) - g(alpha, stopgrad theta~).

    Under data parallelism (`mean`, a `GlobalMean`) every loss value and gradient is the
    global batch's before it is used, each rank weighted by the items its loss averages over
    (a loss's `count` attribute, e.g. `BatchLoss`): the inner steps, the residual, grad f and
    so lambda and the direction are the same on every rank and equal one process's on the
    concatenated batch.

    `inner.joint_value` (a departure from the paper): the value function minimises over the
    head too, v = min over (theta', alpha') of g, so the surrogate is (theta~, alpha~) (alpha~
    steps at its entries of `inner.lr`) and lower_loss takes theta + alpha surrogate tensors.
    v no longer depends on alpha: the head's residual gradient is the training cross-entropy's
    own slope, grad_alpha q = grad_alpha g(alpha, theta), which changes sign at the
    cross-entropy-optimal head; the surrogate only measures q's value.
    """
    theta, alpha = list(theta), list(alpha)
    outer = _Outer(
        alpha, lower_loss, _inner_losses(lower_loss, inner_losses, inner.steps),
        inner.joint_value, mean or GlobalMean(),
    )  # fmt: skip
    n_theta = len(theta)
    # The inner problem's variables: theta (the paper), or theta and the head (joint value).
    inner_vars = theta + alpha if inner.joint_value else theta
    step = persistent.step if persistent is not None else inner.step_rule()
    # Pass 1 at theta, alpha live: grad_theta g is grad_theta q (and the first inner step's
    # gradient when that step is on this batch from theta); grad_alpha g(alpha, theta) is the
    # residual's first alpha term.
    g = lower_loss(None, True)
    grads = torch.autograd.grad(g, theta + alpha, allow_unused=True)
    g, grads = outer.mean.both(g, grads, _count(lower_loss))
    live = _LivePass(g, list(grads[:n_theta]), list(grads[n_theta:]))
    surrogate, g_surrogate, grad_q = _surrogate_and_residual(
        outer, step, persistent, inner_vars, live
    )
    if persistent is not None:
        persistent.tensors = [t.detach() for t in surrogate]
    kept = [t.detach() for t in surrogate] if keep_surrogate else None
    del surrogate, live, step  # free before the entropy pass, the last peak
    f = upper_loss()
    grad_f = torch.autograd.grad(f, theta + alpha, allow_unused=True)
    f, grad_f = outer.mean.both(f, grad_f, _count(upper_loss))
    return BilevelGradients(grad_f, grad_q, g.detach(), g_surrogate.detach(), f.detach(), kept)


def _inner_losses(
    lower_loss: LowerLoss, inner_losses: Sequence[LowerLoss] | None, inner_steps: int
) -> list[LowerLoss]:
    """The losses of a fresh surrogate's inner steps (None: `inner_steps` x `lower_loss`)."""
    if inner_losses is None:
        if inner_steps < 1:
            raise ConfigError(f"inner_steps must be >= 1, got {inner_steps}")
        inner_losses = [lower_loss] * inner_steps
    inner_losses = list(inner_losses)
    if not inner_losses:
        raise ConfigError("a surrogate needs at least one inner step")
    return inner_losses


def _surrogate_and_residual(outer: _Outer, step, persistent, inner_vars, live: _LivePass):
    """theta~ after this outer step's inner steps, g(alpha, theta~) and grad q over
    (theta, alpha)."""
    measured = surrogate = None
    if persistent is not None:
        persistent.resynced = False
    if persistent is not None and persistent.tensors is not None:
        measured, surrogate = _advance_stored(outer, step, persistent, live, len(inner_vars))
    if measured is None:
        if persistent is not None:
            persistent.step.reset()
        first_gradient = live.g_theta + live.g_alpha if outer.joint_value else live.g_theta
        surrogate, g_surrogate, g_alpha_surrogate = _fresh_surrogate(
            outer, step, inner_vars, first_gradient
        )
    else:
        g_surrogate, g_alpha_surrogate = measured
    if outer.joint_value:
        grad_q = live.g_theta + live.g_alpha
    else:
        grad_q = live.g_theta + [
            _sub(a, b) for a, b in zip(live.g_alpha, g_alpha_surrogate, strict=True)
        ]
    return surrogate, g_surrogate, grad_q


def _advance_stored(outer: _Outer, step, persistent, live: _LivePass, n_inner: int):
    """The amortized schedule's stored theta~, measured on this batch and then stepped
    once per inner loss: ((g(alpha, theta~), its alpha gradient), the new theta~), or
    (None, None) when it has fallen behind theta and is to be re-synchronised."""
    # One pass at the stored theta~ gives the residual, its alpha part and the gradient of
    # theta~'s next inner step at once (theta~ is measured before it steps on this batch).
    stored = [t.detach().requires_grad_(True) for t in persistent.tensors]
    g_stored = outer.lower_loss(stored, True)
    wrt = stored if outer.joint_value else stored + outer.alpha
    both = torch.autograd.grad(g_stored, wrt, allow_unused=True)
    g_stored, both = outer.mean.both(g_stored, both, _count(outer.lower_loss))
    if float(live.g - g_stored) >= 0:  # theta~ is ahead of theta: it stands for L*(alpha)
        n_theta = len(live.g_theta)
        measured = (g_stored, None if outer.joint_value else list(both[n_theta:]))
        surrogate = step(stored, list(both[:n_inner]))
        for _ in range(len(outer.inner_losses) - 1):
            surrogate = _inner_step(step, surrogate, outer.lower_loss, outer.mean)
        return measured, surrogate
    # fallen behind the live theta: re-synchronise (fresh inner moments)
    persistent.resyncs += 1
    persistent.resynced = True
    return None, None


def _fresh_surrogate(outer: _Outer, step, inner_vars, first_gradient):
    """theta~ from the live tensors, one inner step per inner loss, then g(alpha, theta~)
    and its alpha gradient (None under the joint value function)."""
    lower_loss, mean, alpha = outer.lower_loss, outer.mean, outer.alpha
    surrogate = [t.detach() for t in inner_vars]
    for index, loss_fn in enumerate(outer.inner_losses):
        if index == 0 and loss_fn is lower_loss:
            # the shared pass: pass 1's gradient is the first inner step's
            surrogate = step(surrogate, first_gradient)
        else:
            surrogate = _inner_step(step, surrogate, loss_fn, mean)
    if outer.joint_value:  # v's value only: it has no alpha-gradient
        with torch.no_grad():
            g_surrogate = mean.value(lower_loss(surrogate, False), _count(lower_loss))
        return surrogate, g_surrogate, None
    g_surrogate = lower_loss(surrogate, False)
    g_alpha_surrogate = torch.autograd.grad(g_surrogate, alpha, allow_unused=True) if alpha else ()
    g_surrogate, g_alpha_surrogate = mean.both(g_surrogate, g_alpha_surrogate, _count(lower_loss))
    return surrogate, g_surrogate, g_alpha_surrogate


def _inner_step(step: InnerStep, surrogate, loss_fn, mean: GlobalMean) -> list[torch.Tensor]:
    """One inner step of theta~ on `loss_fn` (a pass with a graph over theta~ only)."""
    for tensor in surrogate:
        tensor.requires_grad_(True)
    loss = loss_fn(surrogate, True)
    gradients = torch.autograd.grad(loss, surrogate, allow_unused=True)
    return step(surrogate, mean.gradients(gradients, _count(loss_fn)))


class PersistentSurrogate:
    """The amortized schedule's theta~: kept across outer steps, never frozen.

    Each outer step measures q = g(alpha_k, theta_k) - g(alpha_k, theta~) on the current batch
    with the stored theta~ and then moves theta~ by `inner_steps` steps of the inner optimizer
    on that batch, its moments kept from step to step: theta~ keeps descending L_tr(., alpha_k)
    as alpha moves, so q keeps estimating L_tr(theta_k; alpha_k) - L*(alpha_k) (docs/calm.md,
    "Surrogate schedules") at about one extra pass per outer step. When theta~ has fallen
    behind (q < 0: the live theta already does better on this batch), it is re-synchronised:
    theta~ <- theta plus `inner_steps` fresh inner steps (the first reusing pass 1), and q is
    measured with that.
    """

    def __init__(self, step: InnerStep) -> None:
        self.step = step
        self.tensors: list[torch.Tensor] | None = None
        self.resyncs = 0  # re-synchronisations so far (the first fit counts as none)
        self.resynced = False  # whether the last outer step re-synchronised

    def state(self, names: Sequence[str]) -> dict:
        """Checkpoint state (tensors on the CPU, keyed by adapter names)."""
        inner = self.step.state()
        cpu = lambda ts: None if ts is None else [t.detach().cpu() for t in ts]  # noqa: E731
        return {
            "tensors": None
            if self.tensors is None
            else dict(zip(names, cpu(self.tensors), strict=True)),
            "inner": {"count": inner["count"], "m": cpu(inner["m"]), "v": cpu(inner["v"])},
            "resyncs": self.resyncs,
        }

    def load_state(self, state: dict, theta: Sequence[torch.Tensor], names: Sequence[str]):
        place = lambda ts: (  # noqa: E731
            None
            if ts is None
            else [t.to(p.device, p.dtype) for t, p in zip(ts, theta, strict=True)]
        )
        tensors = state.get("tensors")
        self.tensors = None if tensors is None else place([tensors[n] for n in names])
        inner = state["inner"]
        self.step.load_state(
            {"count": inner["count"], "m": place(inner["m"]), "v": place(inner["v"])}
        )
        self.resyncs = int(state.get("resyncs", 0))


def _count(loss_fn) -> int:
    """Items (tokens, questions) a loss averages over on this rank: its weight in the
    global mean (1 for plain callables, which only single-process code passes)."""
    return getattr(loss_fn, "count", 1)


class BatchLoss:
    """A loss on one batch that knows how many items it averages over (`count`)."""

    def __init__(self, fn: Callable, count: int) -> None:
        self.fn, self.count = fn, int(count)

    def __call__(self, *args):
        return self.fn(*args)
