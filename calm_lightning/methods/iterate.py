"""Iterate: alternating single-level updates of the two blocks, without BOME coupling.

Every training batch is one lower step of cross-entropy on the adapters (head frozen); after
every `lower_steps` of them, one upper step on the head of 0.9 * CE - entropy on a held-out
batch (adapters frozen). Plain gradients of each objective; two AdamW optimizers.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from calm_lightning.config_rules import Number
from calm_lightning.errors import ConfigError
from calm_lightning.methods.base import HEAD_CONFIGURED
from calm_lightning.methods.objectives import cross_entropy, mean_entropy, objective_count
from calm_lightning.methods.training import TrainingMethod, first_non_finite
from calm_lightning.runtime.distributed import GlobalMean


class Iterate(TrainingMethod):
    """Alternating lower steps on the adapters and upper steps on the head (no BOME coupling)."""

    head = HEAD_CONFIGURED  # the upper block, `method.head`
    needs_heldout = True  # the upper step reads held-out batches
    supports_fsdp = False  # gradients by torch.autograd.grad (see TrainingMethod)
    config_rules: ClassVar[dict] = {
        "lower_steps": Number(minimum=1, integer=True),
        "lower_lr": Number(minimum=0, exclusive_minimum=True),
        "upper_lr": Number(minimum=0),
        "ce_weight": Number(minimum=0, maximum=1),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        lower_steps: int = 20,
        lower_lr: float = 1e-3,
        upper_lr: float = 1e-5,
        ce_weight: float = 0.9,
        **kwargs,
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.check_arguments(
            lower_steps=lower_steps, lower_lr=lower_lr, upper_lr=upper_lr, ce_weight=ce_weight
        )
        if model.head is None:
            raise ConfigError("Iterate tunes a logit-adjustment head: set method.head")
        self.automatic_optimization = False
        self.lower_steps = int(lower_steps)
        self.lower_lr, self.upper_lr = float(lower_lr), float(upper_lr)
        self.ce_weight = float(ce_weight)
        self.lower_mode = self.upper_mode = "vocab"

    def configure_optimizers(self):
        theta = list(self.model.adapter_parameters().values())
        if not theta:
            raise ConfigError("Iterate trains LoRA adapters: use peft=lora")
        alpha = list(self.model.head_parameters().values())
        opt_theta = self.adamw(theta, self.lower_lr)
        opt_alpha = self.adamw(alpha, self.upper_lr)
        self.lr_factor = self.lr_factor_schedule()
        # The head steps only every `lower_steps` batches; its LR is set from the same factor
        # at each of its steps instead of by a scheduler that would step without it.
        return [opt_theta, opt_alpha], [
            torch.optim.lr_scheduler.LambdaLR(opt_theta, self.lr_factor)
        ]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.lower_mode = self.answer_text_mode(self.resolve_mode("auto", "train"))
        self.upper_mode = self.resolve_mode("auto", "heldout")
        self.set_option_ids(self.lower_mode, self.upper_mode)

    def lower_loss(self, batch: dict) -> torch.Tensor:
        logits, targets = self.scored(batch, self.lower_mode)
        return cross_entropy(logits, targets)

    def upper_loss(self, batch: dict) -> torch.Tensor:
        logits, targets = self.scored(batch, self.upper_mode)
        return self.ce_weight * cross_entropy(logits, targets) - mean_entropy(logits)

    def _step(self, loss: torch.Tensor, params: list, optimizer, name: str, count: int):
        """One block's step on `loss` (a mean over `count` items of this rank's batch);
        returns the loss of the global batch."""
        # Gradients only for this block: the other block stays frozen for this step. They
        # bypass DDP's hooks, so the global batch's mean is formed here (runtime/distributed.py).
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        loss, grads = GlobalMean().both(loss, grads, count)
        if first_non_finite(**{name: loss}):
            self.fail_non_finite(name)
        if first_non_finite(**{f"{name} gradient": list(grads)}):
            self.fail_non_finite(f"{name} gradient")
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    def training_step(self, batch: dict, batch_idx: int) -> None:
        train = batch.get("train", batch)
        opt_theta, opt_alpha = self.optimizers()
        sched_theta = self.lr_schedulers()
        theta = list(self.model.adapter_parameters().values())
        alpha = list(self.model.head_parameters().values())
        lower = self._step(
            self.lower_loss(train),
            theta,
            opt_theta,
            "lower loss",
            objective_count(train, self.lower_mode),
        )
        sched_theta.step()
        logs = {
            "iterate/lower_loss": lower.item(),
            "iterate/lr_lower": opt_theta.param_groups[0]["lr"],
        }
        self.outer_step += 1
        if self.outer_step % self.lower_steps == 0:
            if "heldout" not in batch:
                raise ConfigError("Iterate's upper step needs held-out data (setting.heldout)")
            heldout = batch["heldout"]
            for group in opt_alpha.param_groups:
                group["lr"] = self.upper_lr * self.lr_factor(self.outer_step - 1)
            # Past Lightning's wrapper: `global_step` (trainer.max_steps, step checkpoints)
            # then counts training batches, not batches plus upper steps.
            upper = self._step(
                self.upper_loss(heldout),
                alpha,
                getattr(opt_alpha, "optimizer", opt_alpha),
                "upper loss",
                objective_count(heldout, self.upper_mode),
            )
            logs["iterate/upper_loss"] = upper.item()
            logs.update({f"iterate/{k}": v for k, v in self.model.head.summary().items()})
        self.log_dict(logs, on_step=True, on_epoch=False)
