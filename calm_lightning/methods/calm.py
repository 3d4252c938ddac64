"""CALM: bilevel calibration with a first-order BOME step (one outer step per training batch).

theta = the LoRA adapter tensors, alpha = (d, l) of the logit-adjustment head.
Lower level  g(alpha, theta) = cross-entropy of the adjusted model on a training batch.
Upper level  f(alpha, theta) = - mean entropy of the adjusted model on a held-out batch.

One outer step (docs/calm.md; steps 1-3 are `bome.bilevel_gradients`, the direction of step 4
`bome.bome_direction`):
 1. surrogate theta~ (adapter tensors only, evaluated through `functional_call`: the live
    parameters never move). `per_step` (Algorithm 1): T inner steps from the live theta on this
    batch. `amortized`: one persistent theta~ that keeps descending g(alpha_k, .) by m inner
    steps per outer step, re-synchronised to theta when it falls behind (q < 0);
 2. residual q = g(alpha, theta) - g(alpha, stopgrad theta~):
    grad_theta q = grad_theta g(alpha, theta),
    grad_alpha q = grad_alpha g(alpha, theta) - grad_alpha g(alpha, theta~);
 3. grad f on the held-out batch;
 4. d = grad f + lambda grad q (see `bome.py`), written into .grad; AdamW steps theta at the
    lower LR and alpha at the upper LR; every trainable tensor is clamped to [-c, c].

Cost (per_step): the first inner step shares its pass with grad g(alpha, theta) (same batch,
alpha not detached), and grad_alpha g(alpha, theta~) needs a no-grad LM forward plus a backward
through the head alone: T full passes + 1 forward + 1 entropy pass, instead of the literal
T + 3. Amortized (m = 1): pass 1, one pass at the stored theta~ (its residual, its alpha
gradient and its next inner step at once) and the entropy pass: about 3 passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from calm_lightning.config_rules import Keys, Number, OneOf
from calm_lightning.errors import ConfigError
from calm_lightning.methods.base import HEAD_CONFIGURED
from calm_lightning.methods.bome import (
    INNER_OPTIMIZERS,
    BatchLoss,
    BilevelGradients,
    InnerOptions,
    PersistentSurrogate,
    bilevel_gradients,
    bome_direction,
)
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
from calm_lightning.runtime.distributed import GlobalMean

UPPER_OBJECTIVES = ("auto", "vocab", "options")


SCHEDULES = ("per_step", "amortized")
# The stopping-point variant's switches (docs/calm.md, "CALM with a stopping point"); the first
# value of each is the paper's form.
VALUE_FUNCTIONS = ("lower", "joint")  # v = min over theta' of g | min over (theta', alpha')
LAMBDA_BLOCKS = ("one", "per_block")  # one lambda over (theta, alpha) | one per block
HEAD_STEPS = ("adamw", "sign")  # the head's optimizer: AdamW | sign descent (AdamW, betas 0)
VARIANT_KEYS = ("value_function", "lambda_blocks", "head_step")


@dataclass(frozen=True)
class CALMVariant:
    """The research switches beyond the paper, in one place (`method.module.variant`; the
    defaults are the paper's form, `method=calm_stop` sets all three; docs/calm.md, "CALM with a
    stopping point"): `value_function` joint minimises the value function over the head too
    (the head's residual gradient is the training cross-entropy's slope), `lambda_blocks`
    per_block takes one lambda for the adapters and one per head block, `head_step` sign steps
    the head by sign descent (AdamW with betas 0: each entry moves by the scheduled LR towards
    where its direction changes sign, with no momentum to carry it past). A new switch is a
    field here and a key in calm.yaml's `variant`, not another constructor argument."""

    value_function: str = "lower"
    lambda_blocks: str = "one"
    head_step: str = "adamw"

    @property
    def joint_value(self) -> bool:
        return self.value_function == "joint"

    @property
    def per_block_lambda(self) -> bool:
        return self.lambda_blocks == "per_block"


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
    # The schedule and the inner optimizer are required: their one default is calm.yaml's.
    config_rules: ClassVar[dict] = {
        "inner_steps": Number(minimum=1, integer=True),
        "eta": Number(minimum=0, exclusive_minimum=True),
        "lower_lr": Number(minimum=0, exclusive_minimum=True),
        "upper_lr": Number(minimum=0),  # 0 freezes the head (the frozen-head control)
        "clamp": Number(minimum=0, exclusive_minimum=True),
        "upper_objective": OneOf(UPPER_OBJECTIVES),
        "inner_lr": Number(minimum=0, exclusive_minimum=True, optional=True),
        "inner_optimizer": OneOf(INNER_OPTIMIZERS, required=True),
        "surrogate": Keys(("schedule", "steps")),
        "surrogate.schedule": OneOf(SCHEDULES, required=True),
        "surrogate.steps": Number(minimum=1, integer=True),
        "residual_dropout": OneOf((True, False)),
        "variant": Keys(VARIANT_KEYS),
        "variant.value_function": OneOf(VALUE_FUNCTIONS),
        "variant.lambda_blocks": OneOf(LAMBDA_BLOCKS),
        "variant.head_step": OneOf(HEAD_STEPS),
    }

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
        inner_optimizer: str | None = None,
        surrogate: dict | None = None,
        residual_dropout: bool = False,
        variant: dict | None = None,
        **kwargs,
    ) -> None:
        """`surrogate`: {schedule: per_step | amortized, steps: m inner steps per outer step
        (amortized)}. The schedule and the inner optimizer have no default here: their one
        default is `conf/method/calm.yaml`'s. `residual_dropout`: whether the lower-level
        passes that form q run with the adapters' dropout (off: q is not dropout noise).
        `variant`: the switches beyond the paper (`CALMVariant`; missing keys keep the paper's
        form). `kwargs`: warmup_ratio, min_lr_ratio, betas, weight_decay (TrainingMethod)
        and the shared evaluation options."""
        super().__init__(model, tokenizer, **kwargs)
        self.check_arguments(
            inner_steps=inner_steps,
            eta=eta,
            lower_lr=lower_lr,
            upper_lr=upper_lr,
            clamp=clamp,
            upper_objective=upper_objective,
            inner_lr=inner_lr,
            inner_optimizer=inner_optimizer,
            surrogate=surrogate,
            residual_dropout=residual_dropout,
            variant=variant,
        )
        if model.head is None:
            raise ConfigError("CALM needs a logit-adjustment head: set method.head (vector|scalar)")
        surrogate = dict(surrogate or {})
        self.schedule = surrogate.get("schedule")
        self.surrogate_steps = int(surrogate.get("steps", 1))
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
        self.residual_dropout = bool(residual_dropout)
        self.variant = CALMVariant(**dict(variant or {}))
        self.joint_value = self.variant.joint_value
        self.per_block_lambda = self.variant.per_block_lambda
        self.head_step = self.variant.head_step
        # Resolved from the data in on_fit_start; these defaults serve direct (test) use.
        self.lower_mode = "vocab"
        # The amortized schedule's persistent theta~ (training state: goes into checkpoints).
        self.persistent = (
            PersistentSurrogate(self.inner_options().step_rule())
            if self.schedule == "amortized"
            else None
        )
        # One record per outer step (q, relative q, lambda, ...): the run's curves plot.
        self.history: list[dict[str, float]] = []

    # ----- parameters and optimizers -----
    def _theta(self) -> tuple[list[str], list[torch.nn.Parameter]]:
        named = self.model.adapter_parameters()
        if not named:
            raise ConfigError("CALM trains LoRA adapters: use peft=lora (the model has none)")
        return list(named), list(named.values())

    def _alpha(self) -> list[torch.nn.Parameter]:
        return list(self.model.head_parameters().values())

    def inner_options(self) -> InnerOptions:
        """How theta~ steps, the same in both schedules: rho for the adapters and, with the
        joint value function, each head tensor's copy at its optimizer group's LR (its outer
        step size: calm_token's entries at token_lr, d0 at upper_lr)."""
        steps = self.inner_steps if self.schedule != "amortized" else self.surrogate_steps
        lr: float | tuple[float, ...] = self.inner_lr
        if self.joint_value:
            head = [group["lr"] for group in self.head_groups() for _ in group["params"]]
            lr = tuple([self.inner_lr] * len(self._theta()[1]) + head)
        return InnerOptions(steps, lr, self.inner_optimizer, tuple(self.betas), self.joint_value)

    def _surrogate_names(self) -> list[str]:
        """Names of the surrogate's tensors (adapter names, then `head.<name>` when joint)."""
        names, _ = self._theta()
        if self.joint_value:
            names = names + [f"head.{n}" for n in self.model.head_parameters()]
        return names

    def _blocks(self, n_theta: int, n_alpha: int) -> tuple[int, ...]:
        """The lambda blocks under `lambda_blocks: per_block`: the adapters, the head."""
        return (n_theta, n_alpha)

    def head_groups(self) -> list[dict]:
        """The head optimizer's parameter groups (subclasses with several head blocks give one
        group each): AdamW at the upper LR, or sign descent under `head_step: sign`."""
        return [self.head_group(self._alpha(), self.upper_lr, self.head_step, self.weight_decay)]

    def head_group(self, params, lr: float, step: str, weight_decay: float, eps=None) -> dict:
        """One AdamW parameter group; `step: sign` is AdamW with both betas 0, i.e. sign
        descent (m = g, v = g^2: the step is lr * g / (|g| + eps)), with the same decoupled
        weight decay. `eps`: 1e-12 for sign steps, AdamW's 1e-8 otherwise, unless given."""
        sign = step == "sign"
        eps = (1e-12 if sign else 1e-8) if eps is None else eps
        betas = (0.0, 0.0) if sign else self.betas
        return {"params": list(params), "lr": lr, "betas": betas, "eps": eps,
                "weight_decay": weight_decay}  # fmt: skip

    def configure_optimizers(self):
        _, theta = self._theta()
        opt_theta = self.adamw(theta, self.lower_lr)
        opt_alpha = torch.optim.AdamW(self.head_groups(), lr=self.upper_lr)
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
        """g(alpha, .) on a training batch, optionally with surrogate adapter tensors (and,
        after them, surrogate head tensors: the joint value function's alpha~)."""
        mode = self.lower_mode
        head_names = list(self.model.head_parameters())

        def lower(surrogate: list[torch.Tensor] | None, track: bool) -> torch.Tensor:
            params = head = None
            if surrogate is not None:
                params = dict(zip(names, surrogate[: len(names)], strict=True))
                if len(surrogate) > len(names):
                    head = dict(zip(head_names, surrogate[len(names) :], strict=True))
            with nullcontext() if track else torch.no_grad(), self._residual_dropout():
                raw = self.model.raw_logits(
                    batch["input_ids"], batch["attention_mask"], params=params
                )
            # The head stays outside no_grad: the alpha part of the residual needs its graph.
            logits, targets = adjusted_predictions(
                self.model, raw, batch["labels"], mode, self.option_ids, head_params=head
            )
            return cross_entropy(logits, targets)

        return BatchLoss(lower, objective_count(batch, mode))

    @contextmanager
    def _residual_dropout(self):
        """The lower-level passes (theta and theta~) without dropout unless
        `residual_dropout`: q = g(theta) - g(theta~) then measures the inner steps, not two
        different dropout masks."""
        active = [] if self.residual_dropout else [
            m for m in self.model.modules() if isinstance(m, torch.nn.Dropout) and m.training
        ]  # fmt: skip
        for module in active:
            module.train(False)
        try:
            yield
        finally:
            for module in active:
                module.train(True)

    def upper_loss_fn(self, batch: dict):
        """f(alpha, theta) = - mean entropy on a held-out batch (labels only locate responses)."""

        def upper() -> torch.Tensor:
            logits, _ = self.scored(batch, self.upper_objective)
            return -mean_entropy(logits)

        return BatchLoss(upper, objective_count(batch, self.upper_objective))

    # ----- the outer step -----
    def bilevel_update(self, train: dict, heldout: dict, opt_theta, opt_alpha, schedulers=()):
        """One full CALM update on a training and a held-out batch; returns what to log.

        Stops with NonFiniteError before touching any parameter if a loss or gradient is
        NaN / inf, so the parameters stay at their last finite values.
        """
        names, theta = self._theta()
        alpha = self._alpha()
        lower = self.lower_loss_fn(train, names)
        # Several separate gradients of different objectives (some w.r.t. surrogate tensors
        # that are not parameters) are needed, so torch.autograd.grad replaces
        # manual_backward here; the combined direction is then written into .grad.
        grads = bilevel_gradients(
            theta,
            alpha,
            lower,
            self.upper_loss_fn(heldout),
            self.inner_options(),
            mean=GlobalMean(),
            persistent=self.persistent,
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
        blocks = self._blocks(len(theta), len(alpha)) if self.per_block_lambda else None
        step = bome_direction(grads.grad_f, grads.grad_q, eta=self.eta, blocks=blocks)
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
        self.outer_step += 1
        return grads, step

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.persistent is not None:
            checkpoint["calm_surrogate"] = self.persistent.state(self._surrogate_names())
        checkpoint["calm_history"] = list(self.history)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.history = list(checkpoint.get("calm_history", []))
        stored = checkpoint.get("calm_surrogate")
        if self.persistent is not None and stored is not None:
            _, theta = self._theta()
            inner_vars = theta + self._alpha() if self.joint_value else theta
            self.persistent.load_state(stored, inner_vars, self._surrogate_names())

    def training_step(self, batch: dict, batch_idx: int) -> None:
        train, heldout = (batch["train"], batch["heldout"]) if "heldout" in batch else (batch,) * 2
        opt_theta, opt_alpha = self.optimizers()
        grads, step = self.bilevel_update(
            train, heldout, opt_theta, opt_alpha, self.lr_schedulers()
        )
        self._log_step(grads, step, opt_theta, opt_alpha)

    def _log_step(self, grads: BilevelGradients, step, opt_theta, opt_alpha) -> None:
        head = self.model.head.summary()
        g, q = grads.g.item(), grads.q.item()
        values = {
            "calm/g": g,
            # per_step: q is the drop of this step's T inner steps; amortized: how far the
            # persistent theta~ is ahead of theta on this batch.
            "calm/q": q,
            "calm/q_rel": q / max(abs(g), 1e-12),
            "calm/entropy": -grads.f.item(),
            "calm/lambda": step.lam,  # the adapters' lambda when per block
            "calm/grad_f_norm": step.grad_f_norm,
            "calm/grad_q_norm": step.grad_q_norm,
            "calm/lr_lower": opt_theta.param_groups[0]["lr"],
            "calm/lr_upper": opt_alpha.param_groups[0]["lr"],
            "calm/outer_step": float(self.outer_step),
            **{f"calm/{k}": v for k, v in head.items()},
        }
        if len(step.lambdas) > 1:
            values["calm/lambda_head"] = step.lambdas[-1]
        if len(step.lambdas) > 2:  # calm_token: adapters, d0, the per-token entries
            values["calm/lambda_scale"] = step.lambdas[1]
        # What moves the head's d: the sums over its entries of the entropy term's gradient
        # and of the lambda-weighted residual term's (alpha = scale d, then bias l); a
        # positive value pushes d down, i.e. flattens the distribution.
        # (a log head's entry -2 is s = log d: its gradients have the same sign as d's; the
        # head's lambda is the last block's, the only one without per-block lambdas)
        d_f, d_q = grads.grad_f[-2], grads.grad_q[-2]
        values["calm/d_grad_entropy"] = 0.0 if d_f is None else float(d_f.sum())
        values["calm/d_grad_residual"] = 0.0 if d_q is None else step.lambdas[-1] * float(d_q.sum())
        if self.persistent is not None:
            values["calm/resyncs"] = float(self.persistent.resyncs)
        self.history.append({k.removeprefix("calm/"): v for k, v in values.items()})
        self.log_dict(values, on_step=True, on_epoch=False)
        self.log_dict(
            {"entropy": values["calm/entropy"], "g": g, "q": q, "lam": step.lam},
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            logger=False,
        )

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        """Train, then plot the outer-step curves and keep their summary for metrics.json."""
        fitted = super().calibrate(trainer, datamodule, ckpt_path)
        if not self.history:
            return fitted
        if trainer.is_global_zero:
            from calm_lightning.metrics.curves import plot_calm_curves

            plot_calm_curves(self.history, Path(trainer.default_root_dir) / CURVES_FILE)
        return {**fitted, "calm_steps": summarize_history(self.history)}


CURVES_FILE = "calm_steps.png"
# The per-step series `_log_step` logs that the sweep's W&B dashboard plots for the picked run
# (reporting/dashboard.py): g, q (and q / g), entropy, lambda, the head's statistics.
STEP_SERIES = (
    "calm/g",
    "calm/q",
    "calm/q_rel",
    "calm/entropy",
    "calm/lambda",
    "calm/d_mean",
    "calm/d_std",
    "calm/l_mean",
    "calm/l_std",
)


def summarize_history(history: Sequence[dict[str, float]]) -> dict[str, float]:
    """What the outer steps did, in a few numbers (first / mean / last of the key series)."""
    out: dict[str, float] = {"outer_steps": float(len(history))}
    for key in ("g", "q", "q_rel", "entropy", "lambda", "lambda_head", "d_mean", "d_std"):
        values = [h[key] for h in history if key in h]
        if values:
            out[f"{key}_first"], out[f"{key}_last"] = values[0], values[-1]
            out[f"{key}_mean"] = sum(values) / len(values)
    if "resyncs" in history[-1]:
        out["resyncs"] = history[-1]["resyncs"]
    return out
