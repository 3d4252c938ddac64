"""Pieces every training method shares: optimizers and schedules built the paper's way,
non-finite checks that stop with a useful message, parameter clamping, and checkpoints that
hold only what trains (adapter + head), never the frozen base model."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import ClassVar

import torch

from calm_lightning.config_rules import Number
from calm_lightning.data.resumable import load_pending_loader_states
from calm_lightning.errors import CalmLightningError, ConfigError
from calm_lightning.methods.base import CalibrationMethod
from calm_lightning.methods.objectives import OPTIONS, VOCAB, adjusted_predictions
from calm_lightning.runtime.distributed import GlobalMean, any_rank, gather_objects, world
from calm_lightning.runtime.run_record import LAST_GOOD_CHECKPOINT, checkpoint_file
from calm_lightning.runtime.strategies import uses_fsdp


class NonFiniteError(CalmLightningError):
    """A loss or gradient became NaN or infinite during training."""


def warmup_cosine(total_steps: int, warmup_steps: int, min_ratio: float = 0.0) -> Callable:
    """LR multiplier: linear warmup from 1/(warmup+1) to 1, then cosine down to `min_ratio`."""
    total_steps = max(1, int(total_steps))
    warmup_steps = max(0, min(int(warmup_steps), total_steps - 1))

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        progress = min(1.0, progress)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def first_non_finite(**quantities) -> str | None:
    """Name of the first quantity (tensor, float, or list of tensors) holding NaN / inf."""
    for name, value in quantities.items():
        values = value if isinstance(value, list | tuple) else [value]
        for item in values:
            if item is None:
                continue
            if torch.is_tensor(item):
                if not torch.isfinite(item).all():
                    return name
            elif not math.isfinite(float(item)):
                return name
    return None


@torch.no_grad()
def clamp_(params: Iterable[torch.Tensor], bound: float) -> None:
    """Clamp every parameter into [-bound, bound] in place (the paper's parameter clipping)."""
    for param in params:
        param.clamp_(-bound, bound)


class TrainingMethod(CalibrationMethod):
    """A method that trains LoRA adapters (and a head where it has one) with `Trainer.fit`;
    checkpoints keep trainable tensors only."""

    uses_adapter = True
    # Methods that take gradients with torch.autograd.grad against the adapter tensors
    # (CALM, Iterate) cannot run under FSDP, whose flat parameters hide those tensors.
    supports_fsdp: ClassVar[bool] = True
    changes_model = True
    # With cloze scoring, MCQA training data trains on the answer text and option-level
    # objectives read the cloze option distribution (the scorer's `training_logits`).
    scorers = ("letter", "cloze")
    config_rules: ClassVar[dict] = {
        "warmup_ratio": Number(minimum=0, maximum=1),
        "min_lr_ratio": Number(minimum=0, maximum=1),
        "weight_decay": Number(minimum=0),
    }

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        # Tensors and plain values only: a checkpoint is never unpickled (checkpointing.py).
        trainer.fit(self, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
        return {}

    @classmethod
    def check_requirements(cls, cfg, sources: dict) -> None:
        super().check_requirements(cfg, sources)
        if not cls.supports_fsdp and uses_fsdp(cfg.get("trainer")):
            raise ConfigError(
                f"method={cfg.method.name} does not run under trainer=fsdp: it takes its "
                "gradients with torch.autograd.grad against the adapter tensors, which FSDP's "
                "flat parameters do not expose. Use trainer=ddp (each process holds the frozen "
                "base; model.quantization=nf4 shrinks it to 4 bits)"
            )

    def __init__(
        self,
        model,
        tokenizer=None,
        warmup_ratio: float = 0.4,
        min_lr_ratio: float = 0.0,
        betas=(0.9, 0.95),
        weight_decay: float = 0.02,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(
            warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio, weight_decay=weight_decay
        )
        # Checkpoints omit the frozen base weights, so loading them must not be strict.
        self.strict_loading = False
        self.outer_step = 0
        # Token ids of the option letters, set in on_fit_start when an objective needs them.
        self.option_ids: torch.Tensor | None = None
        self.warmup_ratio = float(warmup_ratio)
        self.min_lr_ratio = float(min_lr_ratio)
        self.betas = tuple(float(b) for b in betas)
        self.weight_decay = float(weight_decay)

    def adamw(self, params, lr: float) -> torch.optim.AdamW:
        """AdamW with the paper's betas and weight decay (shared by every training method)."""
        return torch.optim.AdamW(
            list(params), lr=lr, betas=self.betas, weight_decay=self.weight_decay
        )

    def lr_factor_schedule(self) -> Callable:
        """Linear warmup over `warmup_ratio` of the steps, then cosine to `min_lr_ratio`."""
        total = int(self.trainer.estimated_stepping_batches)
        return warmup_cosine(total, round(self.warmup_ratio * total), self.min_lr_ratio)

    def on_fit_start(self) -> None:
        # HF models load in eval mode and evaluation leaves them there; Lightning keeps each
        # module's mode, so switch to train mode (LoRA dropout on) explicitly.
        self.model.train()

    # ----- what the data is, and which distribution an objective scores -----
    def data_kind(self, split: str) -> str:
        """`mcqa`, `instruction` or `openqa` for a split of the fitted data module."""
        datamodule = getattr(self.trainer, "datamodule", None)
        source = getattr(datamodule, "sources", {}).get(split) if datamodule else None
        return getattr(source, "kind", "instruction")

    def resolve_mode(self, requested: str, split: str) -> str:
        """`auto` = the option distribution (`options`) for MCQA data, the full vocabulary
        (`vocab`) otherwise. The option distribution is the one evaluation scores, as the
        scorer computes it: the option letters at the answer slot, or option likelihood."""
        if requested == "auto":
            return OPTIONS if self.data_kind(split) == "mcqa" else VOCAB
        return requested

    def answer_text_mode(self, mode: str) -> str:
        """A lower level's mode: the answer's cross-entropy. Where the answer is an option (the
        letter) that is the option distribution's; on cloze-format MCQA data it is the answer
        text's (`vocab` over the gold option's tokens)."""
        return mode if self.scorer.answer_is_option else VOCAB

    def scored(self, batch: dict, mode: str, params=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The adjusted logits an objective in `mode` scores and their targets: one forward of
        the batch over the vocabulary, or the scorer's option distribution (with this
        method's option ids)."""
        if mode == VOCAB:
            raw = self.model.raw_logits(batch["input_ids"], batch["attention_mask"], params=params)
            return adjusted_predictions(self.model, raw, batch["labels"], VOCAB)
        scores = self.scorer.training_logits(self.model, batch, self.option_ids, params=params)
        return scores.logits, scores.targets

    def set_option_ids(self, *modes: str) -> None:
        """Look up the option letters' token ids (as training targets spell them) when any of
        the objectives' modes scores options and the scorer reads them."""
        if all(mode == VOCAB for mode in modes):
            self.option_ids = None
            return
        ids = self.scorer.training_option_ids(self.tokenizer)
        self.option_ids = None if ids is None else ids.to(self.device)

    # ----- data parallelism (runtime/distributed.py; identities on one process) -----
    def distributed_mean(self, term: torch.Tensor, count) -> torch.Tensor:
        """`term`, a mean over `count` items of this rank's batch, weighted so that DDP's
        average of the ranks' gradients (and of their logged values) is the global batch's
        mean: world size x this rank's share of the items."""
        if world()[1] == 1:
            return term
        return term * GlobalMean().weight(count).to(term.device)

    def distributed_sum(self, term: torch.Tensor) -> torch.Tensor:
        """`term`, a sum over this rank's batch, weighted so that DDP's average is the global
        batch's sum."""
        return term * world()[1]

    def non_finite_anywhere(self, **quantities) -> str | None:
        """`first_non_finite`, agreed by every rank (a NaN on one rank stops them all at the
        same step instead of leaving the others waiting in a collective)."""
        bad = first_non_finite(**quantities)
        if world()[1] == 1:
            return bad
        return (bad or "a quantity on another process") if any_rank(bad is not None) else None

    def fail_non_finite(self, quantity: str) -> None:
        """Stop with the step and quantity named, after saving the still-finite state."""
        path = self.save_last_good()
        where = f"; last good checkpoint: {path}" if path else ""
        raise NonFiniteError(
            f"{type(self).__name__} step {self.outer_step}: {quantity} is not finite (NaN or "
            f"inf). The parameters were left at their last finite values{where}. Lower the "
            "learning rate(s) in method.module, or check the training data for empty responses."
        )

    def trainable_names(self) -> set[str]:
        return {n for n, p in self.named_parameters() if p.requires_grad}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        keep = self.trainable_names()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        checkpoint["outer_step"] = self.outer_step
        # LoRA dropout draws from the global generator: restoring it makes a resumed run
        # continue with the same masks an uninterrupted run would have drawn.
        # Under DDP each rank draws its own masks: every rank's state is kept (rank 0 writes
        # the file, but every rank builds the checkpoint, so the gather is safe here).
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        states = gather_objects((torch.get_rng_state(), cuda))
        checkpoint["torch_rng_state"], checkpoint["cuda_rng_state"] = states[0]
        if len(states) > 1:
            checkpoint["rng_states_by_rank"] = states

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.outer_step = int(checkpoint.get("outer_step", 0))
        rank, size = world()
        by_rank = checkpoint.get("rng_states_by_rank")
        if by_rank is not None and len(by_rank) == size:
            self._resume_rng = tuple(by_rank[rank])
        else:
            self._resume_rng = (checkpoint.get("torch_rng_state"), checkpoint.get("cuda_rng_state"))

    def on_train_start(self) -> None:
        # Restored here, not in on_load_checkpoint: Lightning loads the checkpoint before
        # anything else of the fit runs, and nothing after this point may draw first.
        cpu, cuda = getattr(self, "_resume_rng", (None, None))
        if cpu is not None:
            torch.set_rng_state(cpu)
        if cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        self._resume_rng = (None, None)
        # A mid-epoch resume continues at the checkpoint's batch (data/resumable.py).
        load_pending_loader_states(self.trainer)

    def save_last_good(self) -> str | None:
        """Write a checkpoint of the current (still finite) state; return its path."""
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return None

        path = checkpoint_file(trainer.default_root_dir, LAST_GOOD_CHECKPOINT)
        path.parent.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(str(path))
        return str(path)
