"""LoRA through peft: target every linear layer except the output projection (by introspection),
with the QLoRA preparation order when the base model is 4-bit.

torch and peft are imported where they are used: the planner reads this module's
checkpointing rule (`checkpointing_enabled`) and must not import torch (`plan --help` and a
whole plan stay torch-free)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from calm_lightning.config_rules import Either, Flag, ListOf, Number, OneOf, Text, check_values

if TYPE_CHECKING:
    from torch import nn

PEFT_METHODS = ("lora", "none")  # `peft.method`: LoRA adapters, or none (the model as loaded)
# The `peft` group's keys (conf/peft/*.yaml); any other LoraConfig argument passes through
# (`+peft.use_rslora=true`) and peft checks it.
PEFT_RULES = {
    "method": OneOf(PEFT_METHODS),
    "r": Number(minimum=1, integer=True),
    "lora_alpha": Number(minimum=0, exclusive_minimum=True),
    "lora_dropout": Number(minimum=0, maximum=1, exclusive_maximum=True),
    "bias": OneOf(("none", "all", "lora_only")),  # peft's LoraConfig.bias
    # all-linear (or null): every linear layer but the output layer; else as peft takes it
    "target_modules": Either(
        (
            Text(optional=True, meaning="all-linear or a regex over module names"),
            ListOf(Text(), nonempty=True, meaning="a list of module names"),
        )
    ),
    # auto: on for models of CHECKPOINTING_FROM parameters or more (checkpointing_enabled)
    "gradient_checkpointing": Either((Flag(), OneOf(("auto",)))),
}
# `peft.gradient_checkpointing=auto` turns checkpointing on from this many parameters. Without it
# a 7B model's activations at 16 x 512 tokens alone exceed an A100 40G (the plan: CALM peaks at
# ~93 GiB without, ~25 GiB with; docs/hardware.md), the paper's GPU; below 3B they fit easily and
# the recomputed forward (~1.5x per pass) would only cost time. On an 80 GB or larger GPU set
# `peft.gradient_checkpointing=false` where `calm-lightning plan` says the job fits.
CHECKPOINTING_FROM = 3_000_000_000


def checkpointing_enabled(value, parameters: int) -> bool:
    """Whether `peft.gradient_checkpointing` (true, false or auto) is on for a model of
    `parameters` parameters (the loaded model's count; the plan uses its shape's)."""
    if str(value).lower() == "auto":
        return parameters >= CHECKPOINTING_FROM
    return bool(value)


def linear_layer_names(model: nn.Module) -> list[str]:
    """Leaf names of all linear layers except the LM head (found by identity, not by name)."""
    from torch import nn

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
    check_values("peft", cfg, PEFT_RULES)
    targets = cfg.pop("target_modules", "all-linear")
    if targets in (None, "all-linear"):
        targets = linear_layer_names(model)
    gradient_checkpointing = checkpointing_enabled(
        cfg.pop("gradient_checkpointing", "auto"), model.num_parameters()
    )
    if quantized:
        from peft import prepare_model_for_kbit_training

        # TRL's order: quantized load -> prepare for k-bit -> (input grads) -> peft wrap.
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing
        )
    elif gradient_checkpointing:  # transformers 5 renamed it; the old name warns
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
        # Frozen embeddings give checkpointed blocks inputs without grad; LoRA needs them.
        model.enable_input_require_grads()
    config = LoraConfig(task_type="CAUSAL_LM", target_modules=targets, **cfg)
    return get_peft_model(model, config)
