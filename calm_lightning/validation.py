"""One pass over a composed config, before anything heavy: every group's value rules, then the
checks that read several groups at once.

Each group declares its rules beside the code that reads its keys (config_rules.py has the
primitives): the model node (models/loading.py, with the model's evaluation defaults from
evaluation/rules.py), `peft` (models/lora.py), `setting` (data/setting_rules.py), `trainer`
(runtime/strategies.py), `logger` (runtime/loggers.py), `evaluation` (evaluation/rules.py),
`method.module` (each method's `config_rules`, merged along its class hierarchy) and
`method.head` (models/calibrated_lm.py). `validate_config` applies them all, then the method's
own requirements, the strategy x quantization refusals, the parallel-sweep refusals and the
random-model checks, so a wrong value stops the run in seconds with the full key, the bad value
and what is allowed, before the config is written, any data is read, any logger is created or
any weights load. This module imports the groups; none of them imports it.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from calm_lightning.config_rules import Flag, Number, Text, check_values, merged_rules
from calm_lightning.data.setting_rules import SETTING_RULES
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.rules import EVALUATION_RULES, MODEL_EVALUATION_RULES
from calm_lightning.models.calibrated_lm import HEAD_RULES
from calm_lightning.models.loading import MODEL_RULES, check_random_model, resolve_quantization
from calm_lightning.models.lora import PEFT_RULES
from calm_lightning.models.model_node import model_parameters
from calm_lightning.runtime.loggers import LOGGER_RULES
from calm_lightning.runtime.multirun import in_multirun
from calm_lightning.runtime.parallel import check_parallel_jobs
from calm_lightning.runtime.strategies import TRAINER_RULES, uses_fsdp

# The primary config's own keys (conf/run.yaml).
RUN_RULES = {
    "seed": Number(integer=True, required=True),
    "ckpt_path": Text(optional=True),
    "oversubscribe_gpus": Flag(),
    "allow_shared_folder": Flag(),
}
# The `method` group's keys besides `module` and `head`: `epochs` for the methods that train.
METHOD_RULES = {
    "name": Text(required=True),
    "epochs": Number(minimum=1, integer=True),
    "epoch_batches": Number(minimum=1, integer=True, optional=True),
}
# A reference model (conf/reference_model/*.yaml) is a model node that names its PoLM.
REFERENCE_MODEL_RULES = {**MODEL_RULES, "pairs_with": Text(optional=True)}


def rule_tables(method_cls) -> dict[str, dict]:
    """Every rule table, by the config node it applies to ("" = the primary config)."""
    return {
        "": RUN_RULES,
        "model": {**MODEL_RULES, **MODEL_EVALUATION_RULES},
        "reference_model": REFERENCE_MODEL_RULES,
        "peft": PEFT_RULES,
        "setting": SETTING_RULES,
        "trainer": TRAINER_RULES,
        "logger": LOGGER_RULES,
        "evaluation": EVALUATION_RULES,
        "method": METHOD_RULES,
        "method.module": merged_rules(method_cls),
        "method.head": HEAD_RULES,
    }


def validate_config(cfg, method_cls, sources: dict, cuda: bool | None = None) -> None:
    """Every check of a composed config that needs neither data nor weights (module doc).
    `cuda`: judge the quantization refusals as on a machine with (or without) a CUDA GPU
    (None: this machine; `preflight` checks a GPU job on a login node with True)."""
    for node, rules in rule_tables(method_cls).items():
        values = _plain(cfg, node, rules)
        if node and not values:  # an empty group (reference_model=none, method without a head)
            continue
        check_values(node, values, rules)
    method_cls.check_requirements(cfg, sources)
    check_quantization(cfg, cuda)
    check_strategy(cfg, cuda)
    check_parallel_jobs(cfg)
    if cfg.model.get("source") == "tiny":
        check_random_model(_plain(cfg, "model", {}))


def _plain(cfg, node: str, rules: dict):
    """The node as plain values, its interpolations resolved ({} when absent). The primary
    config is resolved key by key: only its own keys have rules there, and resolving all of it
    would resolve every group twice."""
    if not node:
        return {key: OmegaConf.select(cfg, key) for key in rules if key in cfg}
    value = OmegaConf.select(cfg, node)
    return OmegaConf.to_container(value, resolve=True) if value is not None else {}


def check_quantization(cfg, cuda: bool | None = None) -> None:
    """The loader's quantization refusals, said before anything loads: `nf4` without CUDA or
    bitsandbytes, and `auto` on CUDA without bitsandbytes for a model of 3B parameters or more
    (its size from its shape, models/model_node.py; a model of no known shape is counted from
    its config.json by the loader, still before its weights load)."""
    for key in ("model", "reference_model"):
        node = _plain(cfg, key, {})
        if node.get("name") in (None, "none") or (
            node.get("source") == "tiny" and not node.get("shape")
        ):
            continue  # no model, or model=tiny (fp32, never quantized: check_random_model)
        default = "none" if node.get("source") == "tiny" else "auto"
        quantization = str(node.get("quantization", default))
        resolve_quantization(quantization, model_parameters(node), key, warn=False, cuda=cuda)


def check_strategy(cfg, cuda: bool | None = None) -> None:
    """Strategy x quantization pairs that cannot work (the method's own refusals, e.g. CALM
    under FSDP, are in its `check_requirements`)."""
    quantization = str(cfg.model.get("quantization", "none"))
    four_bit = quantization == "nf4" or (
        quantization != "none"
        and resolve_quantization(
            quantization, model_parameters(_plain(cfg, "model", {})), warn=False, cuda=cuda
        )  # fmt: skip
    )
    if uses_fsdp(cfg.get("trainer")) and four_bit:
        raise ConfigError(
            f"trainer=fsdp with model.quantization={quantization} (4-bit nf4): FSDP shards "
            "the base weights into flat parameters, which bitsandbytes' 4-bit weights are not "
            "set up for here. Use trainer=fsdp model.quantization=none (the shards already "
            "divide the base's memory by the number of GPUs), or trainer=ddp "
            "model.quantization=nf4"
        )


def check_world_size(trainer, retention_enabled: bool) -> None:
    """Refuse what does not run on several processes, once the trainer knows its world size
    (before the model loads)."""
    if trainer.world_size == 1:
        return
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if in_multirun() and not getattr(environment, "creates_processes_externally", False):
        raise ConfigError(
            f"--multirun with {trainer.world_size} processes per job on this machine: "
            "Lightning starts the other processes by re-running the command line, which would "
            "start the whole sweep again. Run the jobs one at a time (a loop over single "
            "runs), or launch them through SLURM: hydra/launcher=slurm_ddp (docs/scaling.md)"
        )
    if retention_enabled:
        raise ConfigError(
            "evaluation.retention runs lm-eval on one process: with "
            f"{trainer.world_size} processes, drop evaluation.retention.tasks and run "
            "`python -m calm_lightning.retention run_dir=<this run>` afterwards"
        )
