"""The model every method trains and evaluates: a (peft-wrapped) causal LM plus an optional
logit-adjustment head applied to its output, saved and loaded together."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from calm_lightning.config_rules import OneOf
from calm_lightning.models.logit_adjustment import (
    CENTERS,
    HEAD_FILE,
    KINDS,
    PARAMETERIZATIONS,
    LogitAdjustment,
)

# The `method.head` keys: LogitAdjustment's arguments and the choices it takes (its own checks
# stay plain, as logit_adjustment.py travels into exported folders without the project).
HEAD_RULES = {
    "kind": OneOf(KINDS),
    "center": OneOf(CENTERS),
    "parameterization": OneOf(PARAMETERIZATIONS),
}

# A saved calibration folder (a run's calibration/): the PEFT adapter, the head's file and
# what the base was loaded as. An export folder with merge=false reuses the adapter's name.
ADAPTER_DIR = "adapter"
RECORD_FILE = "calibrated_lm.json"


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that ignore left padding.

    The Llama forward does not derive positions from the mask: without this, left-padded
    rows get shifted positions and batched probabilities differ from one-by-one ones.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class CalibratedLM(nn.Module):
    """Causal LM + logit adjustment; `forward` returns adjusted logits."""

    def __init__(self, lm: nn.Module, head: LogitAdjustment | None = None) -> None:
        super().__init__()
        self.lm = lm
        self.head = head

    @property
    def vocab_size(self) -> int:
        return self.lm.get_output_embeddings().weight.shape[0]

    def raw_logits(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int = 0,
        params: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The LM's own logits (B, L or logits_to_keep, V), positions corrected for padding.

        `params` (names relative to `self.lm`) replaces those tensors for this call only, via
        `torch.func.functional_call`: how CALM evaluates its surrogate adapter without ever
        copying the model or touching the live parameters.
        """
        kwargs = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": positions_from_mask(attention_mask),
            "logits_to_keep": logits_to_keep,
            "use_cache": False,
        }
        if params:
            out = torch.func.functional_call(self.lm, params, args=(), kwargs=kwargs, strict=False)
        else:
            out = self.lm(**kwargs)
        return out.logits

    def adjust(self, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Apply the head (identity without one) and return fp32 logits."""
        if self.head is None:
            logits = logits.float()
            return logits if token_ids is None else logits.index_select(-1, token_ids)
        return self.head(logits, token_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int = 0,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.adjust(self.raw_logits(input_ids, attention_mask, logits_to_keep), token_ids)

    def adapter_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Trainable LM parameters (the LoRA tensors), keyed by name relative to `self.lm`."""
        return {n: p for n, p in self.lm.named_parameters() if p.requires_grad}

    def head_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The head's d and l (empty without a head)."""
        return {} if self.head is None else dict(self.head.named_parameters())

    def save(self, directory: str | Path) -> Path:
        """Save only what training changed: the adapter (if any) and the head (if any)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        # What the base was loaded as: the export merges the adapter into a copy of the base
        # at this precision (a 16-bit copy when training saw a 4-bit QLoRA base).
        saved = {"adapter": False, "head": False, **self.base_precision()}
        if hasattr(self.lm, "peft_config"):
            self.lm.save_pretrained(directory / ADAPTER_DIR)
            saved["adapter"] = True
        if self.head is not None:
            self.head.save(directory)
            saved["head"] = True
        (directory / RECORD_FILE).write_text(json.dumps(saved))
        return directory

    def base_precision(self) -> dict:
        """The base model's dtype name and whether it was loaded in 4-bit (QLoRA)."""
        base = self.lm.get_base_model() if hasattr(self.lm, "get_base_model") else self.lm
        dtype = getattr(base.config, "dtype", None)
        if not isinstance(dtype, torch.dtype):
            # Built in code (the tiny model) the config names no dtype; the output layer has
            # the dtype the model computes in (4-bit loads keep it unquantized).
            dtype = self.lm.get_output_embeddings().weight.dtype
        return {
            "base_dtype": str(dtype).removeprefix("torch."),
            "base_4bit": bool(getattr(base, "is_loaded_in_4bit", False)),
        }

    @classmethod
    def load(cls, base_lm: nn.Module, directory: str | Path) -> CalibratedLM:
        """Re-attach a saved adapter and head to a freshly loaded base model."""
        directory = Path(directory)
        lm = base_lm
        if (directory / ADAPTER_DIR).is_dir():
            from peft import PeftModel

            lm = PeftModel.from_pretrained(base_lm, directory / ADAPTER_DIR)
        head = LogitAdjustment.load(directory) if (directory / HEAD_FILE).is_file() else None
        return cls(lm, head)


def read_calibration_record(directory: str | Path) -> dict:
    """What `CalibratedLM.save` recorded in `directory` ({} for a folder saved without it)."""
    path = Path(directory) / RECORD_FILE
    return json.loads(path.read_text()) if path.is_file() else {}
