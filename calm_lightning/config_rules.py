"""Value rules for config keys: the primitives every group's rule table is written with.

A rule table maps a key (dotted for nested keys: `surrogate.schedule`) to a rule;
`check_values(prefix, values, rules)` raises a ConfigError for the first value that breaks its
rule, as `<prefix>.<key>=<value!r> <problem>` (`method.module.inner_steps=0 must be an
integer >= 1`). Each group declares its table beside the code that reads the keys;
validation.py applies them all to the composed config before anything heavy.

Hand-written rather than Hydra structured configs: the method blocks are open dictionaries
passed through `instantiate` to each class, and typing all of them as dataclasses would
duplicate every constructor signature; a rule table keeps one definition per check.

This module imports nothing of the project but errors.py, so any module may use it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from calm_lightning.errors import ConfigError

MISSING = object()  # what `lookup` returns for a key that is not there


@dataclass(frozen=True)
class OneOf:
    """The value is one of `choices` (`required`: a missing key is an error too; `optional`:
    None is allowed, the documented default takes over)."""

    choices: tuple
    required: bool = False
    optional: bool = False

    def allowed(self) -> str:
        return "one of " + ", ".join(str(c) for c in self.choices)

    def problem(self, value) -> str | None:
        if (value is None and self.optional) or value in self.choices:
            return None
        return "is not " + self.allowed()


@dataclass(frozen=True)
class Number:
    """A number within bounds (`integer`: a whole number)."""

    minimum: float | None = None
    maximum: float | None = None
    integer: bool = False
    exclusive_minimum: bool = False
    exclusive_maximum: bool = False
    optional: bool = False  # None allowed (the documented default takes over)
    required: bool = False
    finite: bool = False  # inf and nan refused (bounds alone let nan through)

    def allowed(self) -> str:
        parts = []
        if self.minimum is not None:
            parts.append(f"{'>' if self.exclusive_minimum else '>='} {self.minimum}")
        if self.maximum is not None:
            parts.append(f"{'<' if self.exclusive_maximum else '<='} {self.maximum}")
        kind = "an integer" if self.integer else ("a finite number" if self.finite else "a number")
        return kind + ((" " + " and ".join(parts)) if parts else "")

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        is_number = isinstance(value, int | float) and not isinstance(value, bool)
        if self.finite and is_number and not math.isfinite(value):
            return "must be " + self.allowed()
        if not is_number or (self.integer and float(value) != int(value)):
            return "must be " + self.allowed()
        low_bad = self.minimum is not None and (
            value <= self.minimum if self.exclusive_minimum else value < self.minimum
        )
        high_bad = self.maximum is not None and (
            value >= self.maximum if self.exclusive_maximum else value > self.maximum
        )
        return "must be " + self.allowed() if low_bad or high_bad else None


@dataclass(frozen=True)
class Flag:
    """A boolean: true or false, not a string or a number that looks like one."""

    required: bool = False

    def allowed(self) -> str:
        return "true or false"

    def problem(self, value) -> str | None:
        return None if isinstance(value, bool) else "must be " + self.allowed()


@dataclass(frozen=True)
class Text:
    """A non-empty string (a name, an id, a path), matching `pattern` when given."""

    optional: bool = False  # None allowed
    required: bool = False
    pattern: str | None = None
    meaning: str = "a non-empty string"  # what `pattern` asks for, in words
    empty: bool = False  # "" (or blanks) allowed

    def allowed(self) -> str:
        return self.meaning

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        if not isinstance(value, str) or not (value.strip() or self.empty):
            return "must be " + self.allowed()
        if self.pattern and not re.fullmatch(self.pattern, value):
            return "must be " + self.allowed()
        return None


@dataclass(frozen=True)
class ListOf:
    """A list whose every item passes `item` (`nonempty`: at least one item)."""

    item: object
    nonempty: bool = False
    optional: bool = False
    required: bool = False
    meaning: str | None = None  # what the list holds, in words ("a list of device indices")

    def allowed(self) -> str:
        if self.meaning:
            return self.meaning
        return f"a {'non-empty ' if self.nonempty else ''}list, each item {self.item.allowed()}"

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        if not isinstance(value, list | tuple) or (self.nonempty and not value):
            return "must be " + self.allowed()
        if any(self.item.problem(item) for item in value):
            return "must be " + self.allowed()
        return None


@dataclass(frozen=True)
class Either:
    """The value passes at least one of `rules` (e.g. `auto`, a count, or a list of ids)."""

    rules: tuple
    optional: bool = False
    required: bool = False

    def allowed(self) -> str:
        return "; or ".join(rule.allowed() for rule in self.rules)

    def problem(self, value) -> str | None:
        if value is None and self.optional:
            return None
        if any(rule.problem(value) is None for rule in self.rules):
            return None
        return "must be " + self.allowed()


@dataclass(frozen=True)
class Keys:
    """A mapping whose keys are among `allowed` (e.g. `surrogate: {schedule, steps}`)."""

    names: tuple

    def allowed(self) -> str:
        return "a mapping with keys " + ", ".join(self.names)

    def problem(self, value) -> str | None:
        if value is None:
            return None
        if not isinstance(value, Mapping):
            return "must be " + self.allowed()
        unknown = sorted(set(value) - set(self.names))
        if unknown:
            return f"has unknown keys {unknown}; allowed: {', '.join(self.names)}"
        return None


def lookup(values, dotted: str):
    """`values[a][b]` for "a.b"; `MISSING` when a level is absent."""
    node = values
    for part in dotted.split("."):
        if node is None or not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def check_values(prefix: str, values, rules: Mapping) -> None:
    """Raise a ConfigError for the first value that breaks its rule, naming
    `<prefix>.<key>=<value>` and what is allowed."""
    for key, rule in rules.items():
        value = lookup(values, key)
        if value is MISSING:
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
