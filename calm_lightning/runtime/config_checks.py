"""Value rules for config keys, checked on the whole composed config before anything heavy.

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

from collections.abc import Mapping
from dataclasses import dataclass

from calm_lightning.errors import ConfigError

_MISSING = object()


@dataclass(frozen=True)
class OneOf:
    """The value is one of `choices` (`required`: a missing key is an error too)."""

    choices: tuple
    required: bool = False

    def problem(self, value) -> str | None:
        if value in self.choices:
            return None
        return "is not one of " + ", ".join(str(c) for c in self.choices)


@dataclass(frozen=True)
class Number:
    """A number within bounds (`integer`: a whole number)."""

    minimum: float | None = None
    maximum: float | None = None
    integer: bool = False
    exclusive_minimum: bool = False
    optional: bool = False  # None allowed (the documented default takes over)
    required: bool = False

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        kind = "an integer" if self.integer else "a number"
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if not is_number or (self.integer and float(value) != int(value)):
            return f"must be {kind}{self._range()}"
        low_bad = self.minimum is not None and (
            value <= self.minimum if self.exclusive_minimum else value < self.minimum
        )
        high_bad = self.maximum is not None and value > self.maximum
        return f"must be {kind}{self._range()}" if low_bad or high_bad else None

    def _range(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum}")
        if self.maximum is not None:
            parts.append(f"<= {self.maximum}")
        return (" " + " and ".join(parts)) if parts else ""


@dataclass(frozen=True)
class Keys:
    """A mapping whose keys are among `allowed` (e.g. `surrogate: {schedule, steps}`)."""

    allowed: tuple

    def problem(self, value) -> str | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            return "must be a mapping with keys " + ", ".join(self.allowed)
        unknown = sorted(set(value) - set(self.allowed))
        if unknown:
            return f"has unknown keys {unknown}; allowed: {', '.join(self.allowed)}"
        return None


def lookup(values, dotted: str):
    """`values[a][b]` for "a.b"; `_MISSING` when a level is absent."""
    node = values
    for part in dotted.split("."):
        if node is None or not isinstance(node, Mapping) or part not in node:
            return _MISSING
        node = node[part]
    return node


def check_values(prefix: str, values, rules: Mapping) -> None:
    """Raise a ConfigError for the first value that breaks its rule, naming
    `<prefix>.<key>=<value>` and what is allowed."""
    for key, rule in rules.items():
        value = lookup(values, key)
        if value is _MISSING:
            if not getattr(rule, "required", False):
                continue
            value = None
        problem = rule.problem(value)
        if problem:
            where = f"{prefix}.{key}" if prefix else key
            raise ConfigError(f"{where}={value!r} {problem}")


def merged_rules(cls) -> dict:
    """A class's `config_rules` with those of its bases (a subclass's rule wins)."""
    rules: dict = {}
    for klass in reversed(cls.__mro__):
        rules.update(vars(klass).get("config_rules", {}))
    return rules


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
