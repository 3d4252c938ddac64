"""Lightning strategies built for LoRA models (`trainer=fsdp`; docs/scaling.md), and what a
trainer config's strategy is (FSDP, several processes per job)."""

from __future__ import annotations

import functools

import torch

# Strategy names (or `_target_`s) that start several processes per job.
MULTI_PROCESS = ("ddp", "fsdp", "deepspeed")


def strategy_name(trainer_cfg) -> str:
    """A trainer config's strategy: its name, or its `_target_` ("" for none)."""
    strategy = (trainer_cfg or {}).get("strategy")
    if hasattr(strategy, "get"):
        strategy = strategy.get("_target_", "")
    return str(strategy or "")


def uses_fsdp(trainer_cfg) -> bool:
    """Whether a trainer config asks for Lightning's FSDP (by name or by `_target_`)."""
    return "fsdp" in strategy_name(trainer_cfg).lower()


def is_multi_process(trainer_cfg) -> bool:
    """Whether a trainer config's strategy starts several processes per job (DDP, FSDP, …)."""
    return any(name in strategy_name(trainer_cfg).lower() for name in MULTI_PROCESS)


def trainable_leaf(module: torch.nn.Module) -> bool:
    """A module that owns parameters and all of them train (a LoRA A / B linear, the head)."""
    own = list(module.parameters(recurse=False))
    return bool(own) and all(p.requires_grad for p in own)


def wrap_module(module: torch.nn.Module, suffix: str) -> bool:
    """FSDP's wrap rule: the model's decoder blocks (class name ending in `suffix`) and every
    trainable leaf, so that each flat parameter holds one dtype and one requires_grad value
    (frozen bf16 base weights apart from fp32 adapters)."""
    return type(module).__name__.endswith(suffix) or trainable_leaf(module)


def fsdp_strategy(wrap_suffix: str = "DecoderLayer", **kwargs):
    """Lightning's FSDPStrategy with `wrap_module` as its auto-wrap policy; `kwargs` go to
    FSDPStrategy (sharding_strategy, use_orig_params, limit_all_gathers, state_dict_type)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    policy = functools.partial(
        lambda_auto_wrap_policy,
        lambda_fn=functools.partial(wrap_module, suffix=wrap_suffix),
    )
    return FSDPStrategy(auto_wrap_policy=policy, **kwargs)
