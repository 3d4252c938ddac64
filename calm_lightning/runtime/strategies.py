"""The `trainer` group: Lightning strategies built for LoRA models (`trainer=fsdp`;
docs/scaling.md), what a trainer config's strategy is (FSDP, several processes per job) and the
rules of the Trainer arguments conf/trainer/*.yaml set."""

from __future__ import annotations

import functools

import torch

from calm_lightning.config_rules import Either, Flag, ListOf, Number, OneOf, Text

# Strategy names (or `_target_`s) that start several processes per job.
MULTI_PROCESS = ("ddp", "fsdp", "deepspeed")
# Lightning's precision inputs (lightning.fabric.plugins.precision.precision._PRECISION_INPUT;
# tests/test_config_checks.py compares the two); `${calm_precision:auto}` resolves to one.
PRECISIONS = (
    *("transformer-engine", "transformer-engine-float16", "16-true", "16-mixed", "bf16-true"),
    *("bf16-mixed", "32-true", "64-true", "64", "32", "16", "bf16", 64, 32, 16),
)
# Lightning's accelerator names (its AcceleratorRegistry, with `gpu` and `auto`).
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
# A count (a whole number, 0 = none) or a fraction (a float in [0, 1]) of the batches; null = all.
BATCH_LIMIT = Either((Number(minimum=0, integer=True), Number(minimum=0, maximum=1)), optional=True)

# The plain values among the Trainer's arguments (conf/trainer/*.yaml; `strategy` is a name or
# a `_target_` node that Lightning checks as it builds it).
TRAINER_RULES = {
    "accelerator": OneOf(ACCELERATORS),
    "devices": Either(
        (
            OneOf(("auto", -1)),
            Number(minimum=1, integer=True),
            ListOf(Number(minimum=0, integer=True), nonempty=True, meaning="a list of device ids"),
            Text(pattern=r"-1|\d+(\s*,\s*\d+)*\s*,?", meaning='a string of ids "0,1"'),
        )
    ),
    "num_nodes": Number(minimum=1, integer=True),
    "precision": OneOf(PRECISIONS),
    "max_epochs": Number(minimum=-1, integer=True, optional=True),
    "max_steps": Number(minimum=-1, integer=True),
    "accumulate_grad_batches": Number(minimum=1, integer=True),
    "limit_train_batches": BATCH_LIMIT,
    "limit_test_batches": BATCH_LIMIT,
    "limit_predict_batches": BATCH_LIMIT,
    "log_every_n_steps": Number(minimum=0, integer=True, optional=True),
    "num_sanity_val_steps": Number(minimum=-1, integer=True, optional=True),
    "gradient_clip_val": Number(minimum=0, optional=True),
    "use_distributed_sampler": Flag(),
    "enable_checkpointing": Flag(),
    "enable_model_summary": Flag(),
    "enable_progress_bar": Flag(),
    "default_root_dir": Text(optional=True),
}


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


ONE_PROCESS_FSDP = (
    "trainer=fsdp on one process: FSDP shards nothing there (torch runs it as NO_SHARD), and "
    "in that mode a LoRA model's frozen blocks keep their weights unregistered after a "
    "training step, so no checkpoint can be written (seen on an H200, reproduced on the CPU; "
    "two or more processes shard and save). Use the default trainer on one GPU (the same run, "
    "unsharded), or trainer=fsdp with trainer.devices >= 2"
)


def fsdp_strategy(wrap_suffix: str = "DecoderLayer", **kwargs):
    """Lightning's FSDPStrategy with `wrap_module` as its auto-wrap policy, refusing a world of
    one process (ONE_PROCESS_FSDP); `kwargs` go to FSDPStrategy (sharding_strategy,
    use_orig_params, limit_all_gathers, state_dict_type)."""
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    from calm_lightning.errors import ConfigError

    class ShardedOnlyFSDPStrategy(FSDPStrategy):
        def setup_environment(self) -> None:
            # The device count is known here (trainer.devices=-1 resolves to the visible GPUs).
            if self.world_size < 2:
                raise ConfigError(ONE_PROCESS_FSDP)
            super().setup_environment()

    policy = functools.partial(
        lambda_auto_wrap_policy,
        lambda_fn=functools.partial(wrap_module, suffix=wrap_suffix),
    )
    return ShardedOnlyFSDPStrategy(auto_wrap_policy=policy, **kwargs)
