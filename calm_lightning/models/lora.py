"""LoRA through peft: target every linear layer except the output projection (by introspection),
with the QLoRA preparation order when the base model is 4-bit."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn


def linear_layer_names(model: nn.Module) -> list[str]:
    """Leaf names of all linear layers except the LM head (found by identity, not by name)."""
    output = model.get_output_embeddings()
    names = set()
    for full_name, module in model.named_modules():
        # bitsandbytes' Linear4bit subclasses nn.Linear, so this also covers QLoRA models.
        if isinstance(module, nn.Linear) and module is not output:
            names.add(full_name.rsplit(".", 1)[-1])
    return sorted(names)


def wrap_with_lora(model: nn.Module, peft_cfg: DictConfig | dict, quantized: bool = False):
    """Return a peft model with fresh LoRA adapters (B = 0, so outputs are unchanged)."""
    from peft import LoraConfig, get_peft_model

    cfg: dict[str, Any] = (
        OmegaConf.to_container(peft_cfg, resolve=True)
        if isinstance(peft_cfg, DictConfig)
        else dict(peft_cfg)
    )
    targets = cfg.pop("target_modules", "all-linear")
    if targets in (None, "all-linear"):
        targets = linear_layer_names(model)
    gradient_checkpointing = bool(cfg.pop("gradient_checkpointing", False))
    if quantized:
        from peft import prepare_model_for_kbit_training

        # TRL's order: quantized load -> prepare for k-bit -> (input grads) -> peft wrap.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing
        )
    elif gradient_checkpointing:
        model.gradient_checkpointing_enable()
        # Frozen embeddings give checkpointed blocks inputs without grad; LoRA needs them.
        model.enable_input_require_grads()
    config = LoraConfig(task_type="CAUSAL_LM", target_modules=targets, **cfg)
    return get_peft_model(model, config)
