"""Config checks on the whole composed config before anything heavy (the rule primitives are
in config_rules.py).

A method declares the rules of its `method.module` keys as a class attribute
(`config_rules`, merged along the class hierarchy); the evaluation block's rules are
`evaluation_rules()`. `check_config(cfg)` applies all of them, then the method's requirements
(setting, data kinds, reference model, strategy, precision), so a wrong value stops the run in
seconds, before data or weights load, with the full key, the bad value and what is allowed.
The constructors apply the same rules to their arguments (tests and scripts build methods
directly), so each rule is written once.

Hand-written rather than Hydra structured configs: the method blocks are open dictionaries
passed through `instantiate` to each class, and typing all eleven of them as dataclasses would
duplicate every constructor signature; a rule table keeps one definition per check.
"""

from __future__ import annotations

from calm_lightning.config_rules import Number, OneOf, check_values, merged_rules
from calm_lightning.errors import ConfigError


def evaluation_rules() -> dict:
    """The `evaluation` block's rules (the choices live beside the code that uses them)."""
    from calm_lightning.evaluation.openqa import OpenQASettings
    from calm_lightning.evaluation.scorers import SCORING_RULES

    return {
        **SCORING_RULES,  # scoring, option_tokens, probe_size, cloze.* (the scorers' own rules)
        "n_bins": Number(minimum=1, integer=True),
        "base_cache": OneOf((True, False)),
        "min_accuracy_ratio": Number(minimum=0, maximum=1),
        **{f"openqa.{key}": rule for key, rule in OpenQASettings.rules.items()},
    }


def head_rules() -> dict:
    from calm_lightning.models.logit_adjustment import CENTERS, KINDS, PARAMETERIZATIONS

    return {
        "kind": OneOf(KINDS),
        "center": OneOf(CENTERS),
        "parameterization": OneOf(PARAMETERIZATIONS),
    }


def check_config(cfg, method_cls, sources: dict) -> None:
    """Every value check of a composed config, before the model loads (see module doc)."""
    from omegaconf import OmegaConf

    def plain(node):
        return OmegaConf.to_container(node, resolve=True) if node is not None else {}

    check_values("evaluation", plain(cfg.get("evaluation")), evaluation_rules())
    check_values("method.module", plain(cfg.method.get("module")), merged_rules(method_cls))
    check_values("method.head", plain(cfg.method.get("head")), head_rules())
    method_cls.check_requirements(cfg, sources)
    check_strategy(cfg)
    from calm_lightning.runtime.parallel import check_parallel_jobs

    check_parallel_jobs(cfg)
    if cfg.model.get("source") == "tiny":
        from calm_lightning.models.loading import check_random_model

        check_random_model(plain(cfg.model))


def check_strategy(cfg) -> None:
    """Strategy x quantization pairs that cannot work (the method's own refusals, e.g. CALM
    under FSDP, are in its `check_requirements`)."""
    from calm_lightning.models.loading import resolve_quantization
    from calm_lightning.runtime.strategies import uses_fsdp

    quantization = str(cfg.model.get("quantization", "none"))
    four_bit = quantization == "nf4" or (
        quantization != "none" and resolve_quantization(quantization)
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
    from calm_lightning.runtime.multirun import in_multirun

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
