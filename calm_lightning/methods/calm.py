"""CALM: bilevel calibration with a first-order BOME step (one outer step per training batch).

theta = the LoRA adapter tensors, alpha = (d, l) of the logit-adjustment head.
Lower level  g(alpha, theta) = cross-entropy of the adjusted model on a training batch.
Upper level  f(alpha, theta) = - mean entropy of the adjusted model on a held-out batch.

One outer step (docs/calm.md):
 1. surrogate theta~ <- copy of theta (adapter tensors only), T plain gradient steps on g
    with the lower LR, evaluated through `functional_call` (the live parameters never move);
 2. residual q = g(alpha, theta) - g(alpha, stopgrad theta~):
    grad_theta q = grad_theta g(alpha, theta),
    grad_alpha q = grad_alpha g(alpha, theta) - grad_alpha g(alpha, theta~);
 3. grad f on the held-out batch;
 4. d = grad f + lambda grad q (see `bome.py`), written into .grad; AdamW steps theta at the
    lower LR and alpha at the upper LR; every trainable tensor is clamped to [-c, c].

Cost: the first inner step shares its pass with grad g(alpha, theta) (same batch, alpha not
detached), and grad_alpha g(alpha, theta~) needs a no-grad LM forward plus a backward through
the head alone: T full passes + 1 forward + 1 entropy pass, instead of the literal T + 3.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from calm_lightning.errors import ConfigError
from calm_lightning.methods.base import HEAD_CONFIGURED
from calm_lightning.methods.bome import bome_direction
from calm_lightning.methods.objectives import adjusted_predictions, cross_entropy, mean_entropy
from calm_lightning.methods.training import (
    TrainingMethod,
    clamp_,
    first_non_finite,
)

UPPER_OBJECTIVES = ("auto", "vocab", "options")


@dataclass
class BilevelGradients:
    """Both gradients over (theta, alpha) and the loss values they came from."""

    grad_f: list[torch.Tensor | None]
    grad_q: list[torch.Tensor | None]
    g: torch.Tensor  # g(alpha, theta)
    g_surrogate: torch.Tensor  # g(alpha, theta~)
    f: torch.Tensor  # upper objective (negative entropy)

    @property
    def q(self) -> torch.Tensor:
        return self.g - self.g_surrogate


def _sub(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return None if b is None else -b
    return a if b is None else a - b


def bilevel_gradients(
    theta: Sequence[torch.Tensor],
    alpha: Sequence[torch.Tensor],
    lower_loss: Callable[[list[torch.Tensor] | None, bool], torch.Tensor],
    upper_loss: Callable[[], torch.Tensor],
    inner_steps: int,
    inner_lr: float,
) -> BilevelGradients:
    """The gradients of one CALM outer step, independent of what the model is.

    `lower_loss(None, True)` is g(alpha, theta) with the live tensors; `lower_loss(s, track)`
    is g(alpha, s) with surrogate tensors `s` standing in for theta (`track=False`: the
    surrogate part needs no graph, only the alpha part does). `upper_loss()` is f(alpha, theta).
    """
    if inner_steps < 1:
        raise ConfigError(f"inner_steps must be >= 1, got {inner_steps}")
    theta, alpha = list(theta), list(alpha)
    n_theta = len(theta)
    # Pass 1 at theta, alpha live: grad_theta g is both the first inner step's gradient and
    # grad_theta q; grad_alpha g(alpha, theta) is the residual's first alpha term.
    g = lower_loss(None, True)
    grads = torch.autograd.grad(g, theta + alpha, allow_unused=True)
    g_theta, g_alpha = list(grads[:n_theta]), list(grads[n_theta:])

    def sgd(tensors, gradients):
        # New tensors every step: the surrogate can never alias the live parameters.
        return [
            (t.detach() - inner_lr * gr).detach() if gr is not None else t.detach().clone()
            for t, gr in zip(tensors, gradients, strict=True)
        ]

    surrogate = sgd(theta, g_theta)
    for _ in range(inner_steps - 1):
        for tensor in surrogate:
            tensor.requires_grad_(True)
        loss = lower_loss(surrogate, True)
        step_grads = torch.autograd.grad(loss, surrogate, allow_unused=True)
        surrogate = sgd(surrogate, step_grads)
    g_surrogate = lower_loss(surrogate, False)
    g_alpha_surrogate = torch.autograd.grad(g_surrogate, alpha, allow_unused=True) if alpha else ()
    grad_q = g_theta + [_sub(a, b) for a, b in zip(g_alpha, g_alpha_surrogate, strict=True)]
    del surrogate, g_alpha, g_alpha_surrogate  # free before the entropy pass, the last peak
    f = upper_loss()
    grad_f = list(torch.autograd.grad(f, theta + alpha, allow_unused=True))
    return BilevelGradients(grad_f, grad_q, g.detach(), g_surrogate.detach(), f.detach())


# The direction is written into .grad by hand; fp16 loss scaling would unscale gradients that
# were never scaled.
FP16_PRECISIONS = {"16-mixed", "16"}
FP16_REFUSAL = (
    "CALM supports trainer.precision=bf16-mixed or 32-true, not fp16 (its BOME direction is "
    "written into .grad by hand, which fp16 loss scaling cannot handle): use "
    "trainer.precision=32-true on GPUs without bf16"
)


class CALM(TrainingMethod):
    """The CALM LightningModule (manual optimization, two AdamW optimizers)."""

    head = HEAD_CONFIGURED  # alpha = (d, l), `method.head`

    def __init__(
        self,
        model,
        tokenizer=None,
        inner_steps: int = 20,
        eta: float = 0.5,
        lower_lr: float = 1e-3,
        upper_lr: float = 1e-5,
        clamp: float = 10.0,
        upper_objective: str = "auto",
        **kwargs,
    ) -> None:
        """`kwargs`: warmup_ratio, min_lr_ratio, betas, weight_decay (TrainingMethod) and the
        shared evaluation options."""
        super().__init__(model, tokenizer, **kwargs)
        if upper_objective not in UPPER_OBJECTIVES:
            raise ConfigError(
                f"upper_objective={upper_objective!r} is not one of {', '.join(UPPER_OBJECTIVES)}"
            )
        if model.head is None:
            raise ConfigError("CALM needs a logit-adjustment head: set method.head (vector|scalar)")
        if inner_steps < 1:
            raise ConfigError(f"method.module.inner_steps must be >= 1, got {inner_steps}")
        self.automatic_optimization = False
        self.inner_steps = int(inner_steps)
        self.eta = float(eta)
        self.lower_lr = float(lower_lr)
        self.upper_lr = float(upper_lr)
        self.clamp = float(clamp)
        self.upper_objective = upper_objective
        # Resolved from the data in on_fit_start; these defaults serve direct (test) use.
        self.lower_mode = "vocab"

    # ----- parameters and optimizers -----
    def _theta(self) -> tuple[list[str], list[torch.nn.Parameter]]:
        named = self.model.adapter_parameters()
        if not named:
            raise ConfigError("CALM trains LoRA adapters: use peft=lora (the model has none)")
        return list(named), list(named.values())

    def _alpha(self) -> list[torch.nn.Parameter]:
        return list(self.model.head_parameters().values())

    def configure_optimizers(self):
        _, theta = self._theta()
        opt_theta = self.adamw(theta, self.lower_lr)
        opt_alpha = self.adamw(self._alpha(), self.upper_lr)
        factor = self.lr_factor_schedule()
        schedulers = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in (opt_theta, opt_alpha)]
        return [opt_theta, opt_alpha], schedulers

    @classmethod
    def check_requirements(cls, cfg, sources: dict) -> None:
        super().check_requirements(cfg, sources)
        precision = cfg.get("trainer", {}).get("precision")
        if str(precision) in FP16_PRECISIONS:
            raise ConfigError(FP16_REFUSAL)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if str(self.trainer.precision) in FP16_PRECISIONS:
            raise ConfigError(FP16_REFUSAL)
        self.lower_mode = self.answer_text_mode(self.resolve_mode("auto", "train"))
        self.upper_objective = self.resolve_mode(self.upper_objective, "heldout")
        self.set_option_ids(self.lower_mode, self.upper_objective)

    # ----- objectives -----
    def lower_loss_fn(self, batch: dict, names: list[str]):
        """g(alpha, .) on a training batch, optionally with surrogate adapter tensors."""
        mode = self.lower_mode

        def lower(surrogate: list[torch.Tensor] | None, track: bool) -> torch.Tensor:
            params = dict(zip(names, surrogate, strict=True)) if surrogate is not None else None
            with nullcontext() if track else torch.no_grad():
                raw = self.model.raw_logits(
                    batch["input_ids"], batch["attention_mask"], params=params
                )
            # The head stays outside no_grad: the alpha part of the residual needs its graph.
            logits, targets = adjusted_predictions(
                self.model, raw, batch["labels"], mode, self.option_ids
            )
            return cross_entropy(logits, targets)

        return lower

    def upper_loss_fn(self, batch: dict):
        """f(alpha, theta) = - mean entropy on a held-out batch (labels only locate responses)."""

        def upper() -> torch.Tensor:
            logits, _ = self.scored(batch, self.upper_objective)
            return -mean_entropy(logits)

        return upper

    # ----- the outer step -----
    def bilevel_update(self, train: dict, heldout: dict, opt_theta, opt_alpha, schedulers=()):
        """One full CALM update on a training and a held-out batch; returns what to log.

        Stops with NonFiniteError before touching any parameter if a loss or gradient is
        NaN / inf, so the parameters stay at their last finite values.
        """
        names, theta = self._theta()
        alpha = self._alpha()
        # Several separate gradients of different objectives (some w.r.t. surrogate tensors
        # that are not parameters) are needed, so torch.autograd.grad replaces
        # manual_backward here; the combined direction is then written into .grad.
        grads = bilevel_gradients(
            theta,
            alpha,
            self.lower_loss_fn(train, names),
            self.upper_loss_fn(heldout),
            self.inner_steps,
            self.lower_lr,
        )
        bad = first_non_finite(
            lower_loss=grads.g,
            surrogate_lower_loss=grads.g_surrogate,
            entropy_objective=grads.f,
            upper_gradient=grads.grad_f,
            residual_gradient=grads.grad_q,
        )
        if bad:
            self.fail_non_finite(bad)
        step = bome_direction(grads.grad_f, grads.grad_q, eta=self.eta)
        if first_non_finite(direction=step.direction):
            self.fail_non_finite("update direction")
        for param, direction in zip(theta + alpha, step.direction, strict=True):
            param.grad = direction
        opt_theta.step()
        opt_alpha.step()
        opt_theta.zero_grad(set_to_none=True)
        opt_alpha.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        clamp_(theta + alpha, self.clamp)
        self.outer_step += 1
        return grads, step

    def training_step(self, batch: dict, batch_idx: int) -> None:
        train, heldout = (batch["train"], batch["heldout"]) if "heldout" in batch else (batch,) * 2
        opt_theta, opt_alpha = self.optimizers()
        grads, step = self.bilevel_update(
            train, heldout, opt_theta, opt_alpha, self.lr_schedulers()
        )
        self._log_step(grads, step, opt_theta, opt_alpha)

    def _log_step(self, grads: BilevelGradients, step, opt_theta, opt_alpha) -> None:
        head = self.model.head.summary()
        values = {
            "calm/g": grads.g.item(),
            "calm/q": grads.q.item(),
            "calm/entropy": -grads.f.item(),
            "calm/lambda": step.lam,
            "calm/grad_f_norm": step.grad_f_norm,
            "calm/grad_q_norm": step.grad_q_norm,
            "calm/lr_lower": opt_theta.param_groups[0]["lr"],
            "calm/lr_upper": opt_alpha.param_groups[0]["lr"],
            "calm/outer_step": float(self.outer_step),
            **{f"calm/{k}": v for k, v in head.items()},
        }
        self.log_dict(values, on_step=True, on_epoch=False)
        self.log_dict(
            {"entropy": values["calm/entropy"], "g": values["calm/g"], "lam": step.lam},
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            logger=False,
        )
