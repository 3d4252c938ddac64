"""`method=calm_token`: CALM with a per-token head on a support (docs/calm.md, "A per-token head").

The head is a shared temperature d0 plus per-token biases l_y (optionally scales d_y) on the
support S only: the option tokens of the training and held-out questions (`support: options`),
or the most frequent answer tokens of those splits (`support: responses`, for data without
options). Built on `calm_stop`'s switches (the joint value function: the head's residual
gradient is the training cross-entropy's slope; amortized surrogate), with what the paper's
vector head lacked:

* three lambda blocks: the adapters, d0, the per-token entries (one lambda for all of them lets
  the adapters' geometry decide how far 49,152 head entries move);
* d0 by sign descent (it stops where the training cross-entropy's slope on it changes sign: the
  entropy alone never stops a temperature), the entries by AdamW at their own LR;
* per-token biases, not scales: a bias has a finite entropy maximiser (and a finite
  cross-entropy minimiser for a token that is sometimes the target; none for a support token
  that never is), and a +b distortion of logits scaled by k is undone at the learned temperature
  d0 by a bias of -d0 * b (at a joint stationary point -(c*/k) b, c* the clean problem's optimal
  scale: -b/k only when c* = 1); a per-token scale has no finite entropy
  maximiser (entropy grows as d_y -> 0), so scales are off unless asked for (`token_scale`).
  The entries' block has no stationary point of its own (with lambda > 0 its direction is
  P_perp grad f + eta grad q, two orthogonal parts): the decaying LR and the weight decay end
  their travel (docs/studies/token_calibration.md);
* shrinkage toward the identity: the entries' own weight decay.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import ClassVar

import torch

from calm_lightning.config_rules import Flag, Number, OneOf
from calm_lightning.data.records import InstructionRecord, MCQARecord
from calm_lightning.errors import ConfigError
from calm_lightning.methods.calm import CALM
from calm_lightning.models.token_head import TokenLogitAdjustment

log = logging.getLogger(__name__)

SUPPORTS = ("options", "responses")
TOKEN_STEPS = ("adamw", "sign")


class CALMToken(CALM):
    """CALM (calm_stop's switches) with a shared temperature and per-token entries on a support."""

    config_rules: ClassVar[dict] = {
        **CALM.config_rules,
        "support": OneOf(SUPPORTS),
        "support_size": Number(minimum=1, integer=True),
        "token_scale": Flag(),
        "token_lr": Number(minimum=0),
        "token_weight_decay": Number(minimum=0),
        "token_step": OneOf(TOKEN_STEPS),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        support: str = "options",
        support_size: int = 4096,
        token_scale: bool = False,
        token_lr: float = 0.05,
        token_weight_decay: float = 0.1,
        token_step: str = "adamw",
        **kwargs,
    ) -> None:
        """`support`: options (every token of the training and held-out questions' option
        texts; the letters under letter scoring) | responses (the `support_size` most frequent
        tokens of the training and held-out answers). `token_lr`, `token_weight_decay`,
        `token_step`: the per-token entries' optimizer (0 LR freezes them: the scalar-only
        ablation). The rest is CALM's (calm_stop's values in conf/method/calm_token.yaml)."""
        if model.head is None or model.head.kind != "scalar":
            raise ConfigError(
                "method=calm_token builds on a scalar head: set method.head.kind=scalar"
            )
        # Checked and set before CALM's __init__, which builds the amortized surrogate's inner
        # step from head_groups (the entries' inner LR is token_lr).
        self.check_arguments(
            support=support,
            support_size=support_size,
            token_scale=token_scale,
            token_lr=token_lr,
            token_weight_decay=token_weight_decay,
            token_step=token_step,
        )
        self.support, self.support_size = support, int(support_size)
        self.token_lr, self.token_weight_decay = float(token_lr), float(token_weight_decay)
        self.token_step = token_step
        head = model.head
        model.head = TokenLogitAdjustment(
            head.vocab_size,
            center=head.center,
            parameterization=head.parameterization,
            token_scale=token_scale,
        ).to(head.bias.device)
        super().__init__(model, tokenizer, **kwargs)

    # ----- the support, from the data, before optimizers and checkpoints are built -----
    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage != "fit":
            return
        ids = self.support_ids(self.trainer.datamodule)
        if not ids:
            raise ConfigError(
                f"method=calm_token: the support ({self.support}) is empty for "
                "this data; use method.module.support=responses for data without options"
            )
        self.model.head.set_support(ids)
        log.info("calm_token: %d per-token entries (support: %s)", len(ids), self.support)

    def support_ids(self, datamodule) -> list[int]:
        records = [r for split in ("train", "heldout") for r in datamodule._load(split)]
        if self.support != "responses":  # options
            questions = [r for r in records if isinstance(r, MCQARecord)]
            if not questions:
                return []
            if self.scorer.answer_is_option:  # letter scoring: the letters
                ids = self.scorer.training_option_ids(self.tokenizer)
                return [] if ids is None else [int(i) for i in ids]
            return list(self.scorer.head_token_ids(self.tokenizer, questions, None))
        counts: Counter = Counter()
        for record in records:
            for text in answer_texts(record):
                counts.update(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return [token for token, _ in counts.most_common(self.support_size)]

    # ----- three blocks: adapters, d0, per-token entries -----
    def _alpha(self) -> list[torch.nn.Parameter]:
        head = self.model.head
        return head.shared_parameters() + head.token_parameters()

    def _blocks(self, n_theta: int, n_alpha: int) -> tuple[int, ...]:
        n_shared = len(self.model.head.shared_parameters())
        return (n_theta, n_shared, n_alpha - n_shared)

    def head_groups(self) -> list[dict]:
        # d0 by sign descent (calm_stop's); the entries by AdamW (or sign) with their own LR
        # and weight decay (the shrinkage toward l = 0, d_y = 1). Both at eps 1e-12.
        head = self.model.head
        return [
            self.head_group(head.shared_parameters(), self.upper_lr, "sign", self.weight_decay),
            self.head_group(head.token_parameters(), self.token_lr, self.token_step,
                            self.token_weight_decay, eps=1e-12),
        ]  # fmt: skip

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        """Train, then replace the head by its dense vector form (the same function) for
        evaluation, saving and export; the record keeps the entries' summary."""
        fitted = super().calibrate(trainer, datamodule, ckpt_path)
        head = self.model.head
        summary = {**head.summary(), "support": int(head.support.numel())}
        self.model.head = head.to_vector()
        return {**fitted, "token_head": summary}


def answer_texts(record) -> list[str]:
    """The answer texts of a training or held-out record (the support's `responses`)."""
    if isinstance(record, MCQARecord):
        return [record.choices[record.answer]]
    if isinstance(record, InstructionRecord):
        return [record.output]
    return list(getattr(record, "answers", ()))[:1]
