"""The post-hoc protocol of the Dual-Align paper: one pool of questions, a seeded fraction (30 %)
to fit a calibrator on (labels unused by the unsupervised methods), the rest (70 %) to test.

`FitTestSplit` wraps any MCQA source and returns one of the two parts, so a setting names the
same wrapped source for `heldout` (part: fit) and `test` (part: test): every method of the
family, and the `base` row, is evaluated on exactly the same questions for a given seed.
"""

from __future__ import annotations

import random

from calm_lightning.errors import ConfigError

PARTS = ("fit", "test")


class FitTestSplit:
    """The `fit` or `test` part of a seeded shuffle of `source`'s records."""

    def __init__(self, source, part: str, fit_fraction: float = 0.3, seed: int = 0) -> None:
        if part not in PARTS:
            raise ConfigError(f"fit/test split part {part!r} is not one of {', '.join(PARTS)}")
        if not 0.0 < float(fit_fraction) < 1.0:
            raise ConfigError(f"fit_fraction must lie strictly between 0 and 1, got {fit_fraction}")
        self.source = source
        self.part = part
        self.fit_fraction = float(fit_fraction)
        self.seed = int(seed)
        self.kind = source.kind
        self.name = f"{source.name}_{part}"

    def load(self) -> list:
        records = list(self.source.load())
        order = list(range(len(records)))
        random.Random(f"fit-test-{self.seed}").shuffle(order)
        n_fit = round(self.fit_fraction * len(records))
        chosen = sorted(order[:n_fit] if self.part == "fit" else order[n_fit:])
        return [records[i] for i in chosen]  # dataset order within each part

    def describe(self) -> dict:
        return {
            "name": self.name,
            "kind": self.kind,
            "part": self.part,
            "fit_fraction": self.fit_fraction,
            "seed": self.seed,
            "source": self.source.describe(),
        }
