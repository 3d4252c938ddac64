"""What a method declares about itself for the planner and the report: the `traits:` block of
its `conf/method/*.yaml`. `plan` prices a job and `report` draws its dashboard from these, never
from the method's name, so a new method gets the right plan and panels by declaring them
(docs/architecture.md, "Adding a method"). Torch-free: `plan` never imports torch.

It imports nothing of the project but config_rules.py and errors.py (layer row 3, beside runtime/).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from omegaconf import OmegaConf

from calm_lightning.config_rules import Flag, ListOf, Number, OneOf, Text, check_values
from calm_lightning.errors import ConfigError

# none: post hoc or the model as it is (no training steps); single: one loss per step;
# alternating: lower steps with an upper step every few (Iterate); bilevel: CALM's outer step
# (inner steps on a surrogate, the held-out entropy pass, the BOME direction).
TRAININGS = ("none", "single", "alternating", "bilevel")

TRAIT_RULES = {
    "training": OneOf(TRAININGS, required=True),
    "forward_first": Flag(required=True),
    "heldout_forward": Flag(required=True),
    "step_series": ListOf(Text(), required=True),
    "paper_cost_row": Text(optional=True),
    "table_position": Number(minimum=0, integer=True, required=True),
}

UNLISTED_POSITION = 10**6  # a run saved before traits existed: listed after every method


@dataclass(frozen=True)
class MethodTraits:
    """A method's traits (see TRAIT_RULES and conf/method/calm.yaml's comments)."""

    training: str
    forward_first: bool = False
    heldout_forward: bool = False
    step_series: tuple[str, ...] = ()
    paper_cost_row: str | None = None
    table_position: int = UNLISTED_POSITION

    @property
    def bilevel(self) -> bool:
        return self.training == "bilevel"

    @property
    def trains(self) -> bool:
        return self.training != "none"


def method_traits(method) -> MethodTraits:
    """The traits of a composed (OmegaConf) or saved (dict) `method` block; a block without
    them, or with a bad value, is a ConfigError naming the method's file and the key."""
    name = method.get("name") or "?"
    traits = method.get("traits")
    if traits is None:
        raise ConfigError(
            f"method {name} declares no traits: add a `traits:` block to conf/method/{name}.yaml "
            "(what plan and report read; docs/architecture.md, 'Adding a method')"
        )
    if OmegaConf.is_config(traits):
        traits = OmegaConf.to_container(traits, resolve=True)
    check_values("method.traits", traits, TRAIT_RULES)
    unknown = sorted(set(traits) - set(TRAIT_RULES))
    if unknown:
        raise ConfigError(
            f"method.traits has unknown keys {unknown}; allowed: {', '.join(TRAIT_RULES)}"
        )
    return MethodTraits(
        training=str(traits["training"]),
        forward_first=bool(traits["forward_first"]),
        heldout_forward=bool(traits["heldout_forward"]),
        step_series=tuple(str(s) for s in traits["step_series"]),
        paper_cost_row=traits.get("paper_cost_row"),
        table_position=int(traits["table_position"]),
    )


def saved_traits(config: Mapping) -> MethodTraits | None:
    """The traits a saved run's config records; None for a run saved before traits existed
    (the report then lists it last and draws no step panels for it)."""
    method = config.get("method") if isinstance(config, Mapping) else None
    if not isinstance(method, Mapping) or "traits" not in method:
        return None
    return method_traits(method)
