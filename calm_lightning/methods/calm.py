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

from calm_lightning.distributed import GlobalMean
from calm_lightning.errors import ConfigError
from calm_lightning.methods.base import HEAD_CONFIGURED
from calm_lightning.methods.bome import bome_direction
from calm_lightning.methods.objectives import (
    adjusted_predictions,
    cross_entropy,
    mean_entropy,
    objective_count,
)
from calm_lightning.methods.training import (
    TrainingMethod,
    clamp_,
    first_non_finite,
)

UPPER_OBJECTIVES = ("auto", "vocab", "options")


INNER_OPTIMIZERS = ("sgd", "adam")
SCHEDULES = ("per_step", "amortized")
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
    """The surrogate's update rule: `sgd` (t <- t - rho g) or `adam` (Adam moments started
    afresh at every surrogate fit, bias-corrected, no weight decay: each element moves by about
    rho per step, the scale the outer AdamW moves theta by)."""

    def __init__(self, kind: str, lr: float, betas=(0.9, 0.95), eps: float = 1e-8) -> None:
        if kind not in INNER_OPTIMIZERS:
            choices = ", ".join(INNER_OPTIMIZERS)
            raise ConfigError(f"inner_optimizer={kind!r} is not one of {choices}")
        self.kind, self.lr, self.betas, self.eps = kind, float(lr), tuple(betas), eps
        self.count, self.m, self.v = 0, None, None

    @torch.no_grad()
    def __call__(self, tensors, gradients) -> list[torch.Tensor]:
        # New tensors every step: the surrogate can never alias the live parameters.
        if self.kind == "sgd":
            return [
                t.detach() - self.lr * gr if gr is not None else t.detach().clone()
                for t, gr in zip(tensors, gradients, strict=True)
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
            out.append(t.detach() - self.lr * step)
        return out


def bilevel_gradients(
    theta: Sequence[torch.Tensor],
    alpha: Sequence[torch.Tensor],
    lower_loss: LowerLoss,
    upper_loss: Callable[[], torch.Tensor],
    inner_steps: int,
    inner_lr: float,
    *,
    inner_losses: Sequence[LowerLoss] | None = None,
    start: Sequence[torch.Tensor] | None = None,
    inner_optimizer: str = "sgd",
    betas=(0.9, 0.95),
    keep_surrogate: bool = False,
    mean: GlobalMean | None = None,
) -> BilevelGradients:
    """The gradients of one CALM outer step, independent of what the model is.

    `lower_loss(None, True)` is g(alpha, theta) on the current batch with the live tensors;
    `lower_loss(s, track)` is g(alpha, s) with surrogate tensors `s` standing in for theta
    (`track=False`: the surrogate part needs no graph, only the alpha part does).
    `upper_loss()` is f(alpha, theta).

    The surrogate theta~ starts at `start` (None: theta) and takes one inner step on each of
    `inner_losses` (None: `inner_steps` steps on `lower_loss`, the per-step schedule; an empty
    list: theta~ = `start` as given, the amortized schedule between refreshes). A first step
    from theta on `lower_loss` itself reuses pass 1's gradient. The residual is always
    measured on the current batch: q = g(alpha, theta) - g(alpha, stopgrad theta~).

    Under data parallelism (`mean`, a `GlobalMean`) every loss value and gradient is the
    global batch's before it is used, each rank weighted by the items its loss averages over
    (a loss's `count` attribute, e.g. `BatchLoss`): the inner steps, the residual, grad f and
    so lambda and the direction are the same on every rank and equal one process's on the
    concatenated batch.
    """
    if inner_losses is None:
        if inner_steps < 1:
            raise ConfigError(f"inner_steps must be >= 1, got {inner_steps}")
        inner_losses = [lower_loss] * inner_steps
    inner_losses = list(inner_losses)
    if start is None and not inner_losses:
        raise ConfigError("a surrogate needs inner steps or a stored starting point")
    theta, alpha = list(theta), list(alpha)
    n_theta = len(theta)
    step = InnerStep(inner_optimizer, inner_lr, betas)
    # Pass 1 at theta, alpha live: grad_theta g is grad_theta q (and the first inner step's
    # gradient when that step is on this batch from theta); grad_alpha g(alpha, theta) is the
    # residual's first alpha term.
    mean = mean or GlobalMean()
    g = lower_loss(None, True)
    grads = torch.autograd.grad(g, theta + alpha, allow_unused=True)
    g, grads = mean.both(g, grads, _count(lower_loss))
    g_theta, g_alpha = list(grads[:n_theta]), list(grads[n_theta:])

    surrogate = [t.detach() for t in (theta if start is None else start)]
    for index, loss_fn in enumerate(inner_losses):
        if index == 0 and start is None and loss_fn is lower_loss:
            step_grads = g_theta  # the shared pass
        else:
            for tensor in surrogate:
                tensor.requires_grad_(True)
            loss = loss_fn(surrogate, True)
            step_grads = torch.autograd.grad(loss, surrogate, allow_unused=True)
            step_grads = mean.gradients(step_grads, _count(loss_fn))
        surrogate = step(surrogate, step_grads)
    g_surrogate = lower_loss(surrogate, False)
    g_alpha_surrogate = torch.autograd.grad(g_surrogate, alpha, allow_unused=True) if alpha else ()
    g_surrogate, g_alpha_surrogate = mean.both(g_surrogate, g_alpha_surrogate, _count(lower_loss))
    grad_q = g_theta + [_sub(a, b) for a, b in zip(g_alpha, g_alpha_surrogate, strict=True)]
    kept = [t.detach() for t in surrogate] if keep_surrogate else None
    del surrogate, g_alpha, g_alpha_surrogate, step  # free before the entropy pass, the last peak
    f = upper_loss()
    grad_f = torch.autograd.grad(f, theta + alpha, allow_unused=True)
    f, grad_f = mean.both(f, grad_f, _count(upper_loss))
    return BilevelGradients(grad_f, grad_q, g.detach(), g_surrogate.detach(), f.detach(), kept)


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
    supports_fsdp = False  # gradients by torch.autograd.grad (see TrainingMethod)

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
        inner_lr: float | None = None,
        inner_optimizer: str = "sgd",
        surrogate: dict | None = None,
        **kwargs,
    ) -> None:
        """`surrogate`: {schedule: per_step | amortized, refresh_every: None (once per epoch)
        or a number of outer steps}. `kwargs`: warmup_ratio, min_lr_ratio, betas, weight_decay
        (TrainingMethod) and the shared evaluation options."""
        super().__init__(model, tokenizer, **kwargs)
        if upper_objective not in UPPER_OBJECTIVES:
            raise ConfigError(
                f"upper_objective={upper_objective!r} is not one of {', '.join(UPPER_OBJECTIVES)}"
            )
        if model.head is None:
            raise ConfigError("CALM needs a logit-adjustment head: set method.head (vector|scalar)")
        if inner_steps < 1:
            raise ConfigError(f"method.module.inner_steps must be >= 1, got {inner_steps}")
        if inner_optimizer not in INNER_OPTIMIZERS:
            raise ConfigError(
                f"method.module.inner_optimizer={inner_optimizer!r} is not one of "
                f"{', '.join(INNER_OPTIMIZERS)}"
            )
        surrogate = dict(surrogate or {})
        unknown = set(surrogate) - {"schedule", "refresh_every"}
        if unknown:
            raise ConfigError(f"method.module.surrogate takes no {sorted(unknown)}")
        self.schedule = surrogate.get("schedule", "per_step")
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"method.module.surrogate.schedule={self.schedule!r} is not one of "
                f"{', '.join(SCHEDULES)}"
            )
        refresh_every = surrogate.get("refresh_every")
        if refresh_every is not None and int(refresh_every) < 1:
            raise ConfigError("method.module.surrogate.refresh_every must be >= 1 or null")
        self.refresh_every = None if refresh_every is None else int(refresh_every)
        self.automatic_optimization = False
        self.inner_steps = int(inner_steps)
        self.eta = float(eta)
        self.lower_lr = float(lower_lr)
        self.upper_lr = float(upper_lr)
        # rho, the inner step size: the lower LR unless set (unscheduled either way).
        self.inner_lr = self.lower_lr if inner_lr is None else float(inner_lr)
        self.inner_optimizer = inner_optimizer
        self.clamp = float(clamp)
        self.upper_objective = upper_objective
        # Resolved from the data in on_fit_start; these defaults serve direct (test) use.
        self.lower_mode = "vocab"
        # The amortized schedule's stored surrogate (adapter tensors, detached) and when it
        # was fitted; all of it is training state and goes into checkpoints.
        self.surrogate: list[torch.Tensor] | None = None
        self.surrogate_step = 0  # outer step of the last refresh
        self.surrogate_epoch = -1  # epoch of the last refresh
        self.refreshes = 0  # surrogate fits so far (also seeds which batches the next one reads)
        self._refreshed = False  # whether the last outer step fitted theta~ afresh
        self._inner_drop = (0.0, 0.0)  # (absolute, relative) inner drop at the last fit

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

        return BatchLoss(lower, objective_count(batch, mode))

    def upper_loss_fn(self, batch: dict):
        """f(alpha, theta) = - mean entropy on a held-out batch (labels only locate responses)."""

        def upper() -> torch.Tensor:
            logits, _ = self.scored(batch, self.upper_objective)
            return -mean_entropy(logits)

        return BatchLoss(upper, objective_count(batch, self.upper_objective))

    # ----- the surrogate schedule -----
    def _epoch(self) -> int:
        trainer = self._trainer
        return int(trainer.current_epoch) if trainer is not None else 0

    def refresh_due(self) -> bool:
        """Amortized schedule: fit theta~ afresh at this outer step? (per_step: always.)"""
        if self.schedule == "per_step" or self.surrogate is None:
            return True
        if self.refresh_every is None:
            return self.surrogate_epoch != self._epoch()
        return self.outer_step - self.surrogate_step >= self.refresh_every

    def surrogate_batches(self, n: int) -> list[dict]:
        """`n` training batches for a refresh beyond the current one, distinct from each
        other, in an order of their own (`datamodule.surrogate_dataloader()`) that depends only
        on the number of refreshes so far, so a resumed run reads the same ones."""
        if n == 0:
            return []
        datamodule = getattr(self._trainer, "datamodule", None)
        if datamodule is None or not hasattr(datamodule, "surrogate_dataloader"):
            raise ConfigError(
                "surrogate.schedule=amortized reads its inner batches from the data module's "
                "surrogate_dataloader(); run CALM through Trainer.fit with a "
                "CalibrationDataModule"
            )
        from lightning.pytorch.utilities import move_data_to_device

        loader = datamodule.surrogate_dataloader()
        batches: list[dict] = []
        for sweep in range(n + 1):  # more sweeps only when the split holds fewer than n batches
            loader.batch_sampler.set_epoch(self.refreshes * 10_007 + sweep)
            for batch in loader:
                batches.append(move_data_to_device(batch, self.device))
                if len(batches) == n:
                    return batches
        raise ConfigError("the training split yields no batches for the surrogate")

    # ----- the outer step -----
    def bilevel_update(self, train: dict, heldout: dict, opt_theta, opt_alpha, schedulers=()):
        """One full CALM update on a training and a held-out batch; returns what to log.

        Stops with NonFiniteError before touching any parameter if a loss or gradient is
        NaN / inf, so the parameters stay at their last finite values.
        """
        names, theta = self._theta()
        alpha = self._alpha()
        lower = self.lower_loss_fn(train, names)
        refresh = self.refresh_due()
        if self.schedule == "per_step":
            surrogate = {"inner_losses": None}
        elif refresh:
            # T distinct batches from theta: this step's batch (sharing pass 1) and T - 1 more.
            extra = self.surrogate_batches(self.inner_steps - 1)
            inner = [lower] + [self.lower_loss_fn(b, names) for b in extra]
            surrogate = {"inner_losses": inner, "keep_surrogate": True}
        else:
            stored = [s.to(p.device, p.dtype) for s, p in zip(self.surrogate, theta, strict=True)]
            surrogate = {"inner_losses": [], "start": stored}
        # Several separate gradients of different objectives (some w.r.t. surrogate tensors
        # that are not parameters) are needed, so torch.autograd.grad replaces
        # manual_backward here; the combined direction is then written into .grad.
        grads = bilevel_gradients(
            theta,
            alpha,
            lower,
            self.upper_loss_fn(heldout),
            self.inner_steps,
            self.inner_lr,
            inner_optimizer=self.inner_optimizer,
            betas=self.betas,
            mean=GlobalMean(self.device),
            **surrogate,
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
        # The head's optimizer steps past Lightning's wrapper, so `global_step` (and with it
        # trainer.max_steps, step checkpoints and logger steps) counts outer steps, not two
        # optimizer steps per outer step. Safe: fp16 loss scaling is refused for CALM.
        getattr(opt_alpha, "optimizer", opt_alpha).step()
        opt_theta.zero_grad(set_to_none=True)
        opt_alpha.zero_grad(set_to_none=True)
        for scheduler in schedulers:
            scheduler.step()
        clamp_(theta + alpha, self.clamp)
        self._refreshed = refresh
        if refresh:
            if grads.surrogate is not None:  # amortized: kept until the next refresh
                self.surrogate = grads.surrogate
            self.surrogate_step, self.surrogate_epoch = self.outer_step, self._epoch()
            self.refreshes += 1
        self.outer_step += 1
        return grads, step

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.surrogate is not None:
            names, _ = self._theta()
            checkpoint["calm_surrogate"] = {
                "tensors": dict(
                    zip(names, (t.detach().cpu() for t in self.surrogate), strict=True)
                ),
                "step": self.surrogate_step,
                "epoch": self.surrogate_epoch,
                "inner_drop": self._inner_drop,
            }
        checkpoint["calm_refreshes"] = self.refreshes

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.refreshes = int(checkpoint.get("calm_refreshes", 0))
        stored = checkpoint.get("calm_surrogate")
        if stored is None:
            self.surrogate = None
            return
        names, theta = self._theta()
        tensors = stored["tensors"]
        self.surrogate = [
            tensors[n].to(p.device, p.dtype) for n, p in zip(names, theta, strict=True)
        ]
        self.surrogate_step, self.surrogate_epoch = int(stored["step"]), int(stored["epoch"])
        self._inner_drop = tuple(stored.get("inner_drop", (0.0, 0.0)))

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
            "calm/refreshes": float(self.refreshes),
            **{f"calm/{k}": v for k, v in head.items()},
        }
        if self._refreshed:
            # g(theta) - g(theta~) on this batch right after theta~ was fitted: how far the
            # inner steps moved the lower loss (per_step: every step, where it equals q).
            self._inner_drop = (grads.q.item(), grads.q.item() / max(abs(grads.g.item()), 1e-12))
        # Between refreshes: the drop the stored theta~ had when it was fitted.
        values["calm/inner_drop"], values["calm/inner_drop_rel"] = self._inner_drop
        values["calm/surrogate_age"] = float(self.outer_step - 1 - self.surrogate_step)
        self.log_dict(values, on_step=True, on_epoch=False)
        self.log_dict(
            {"entropy": values["calm/entropy"], "g": values["calm/g"], "lam": step.lam},
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            logger=False,
        )
