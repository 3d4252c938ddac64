"""What every preflight check is made of: the statuses, one check's row, one job's report, the
memo that runs a shared check once, and the guard that turns a check's error into a row
(planning/preflight.py, planning/model_checks.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field

from omegaconf import OmegaConf

from calm_lightning.errors import (
    CalmLightningError,
    DataUnavailableError,
    ModelUnavailableError,
    first_line,
)

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
SEVERITY = {PASS: 0, SKIP: 1, WARN: 2, FAIL: 3}
CHECKS = ("config", "data", "tokenizer", "model", "memory", "time", "revision")
SPLITS = ("train", "heldout", "test")
# Where a check cannot run on a login node (no network, nothing cached): SKIP, not FAIL.
UNAVAILABLE = (DataUnavailableError, ModelUnavailableError)
UNWRITTEN_FOLDER = "/nonexistent/calm-lightning-preflight"  # paths.output_dir: never created


@dataclass
class Check:
    """One check of one job: its name, PASS / WARN / FAIL / SKIP and why."""

    name: str
    status: str
    detail: str = ""


@dataclass
class JobReport:
    """A job's overrides and its checks, in CHECKS order (a check may have several rows:
    `data.train`, `data.test`, ...)."""

    overrides: list[str]
    checks: list[Check] = field(default_factory=list)

    def status(self, name: str) -> str:
        """The worst status among the rows of check `name` (`data` covers `data.*`)."""
        rows = [c.status for c in self.checks if c.name == name or c.name.startswith(name + ".")]
        return max(rows, key=SEVERITY.__getitem__) if rows else SKIP

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)


class Memo:
    """Checks shared by many jobs run once: results keyed by what they read."""

    def __init__(self) -> None:
        self._done: dict[str, object] = {}
        self.hits = 0

    def get(self, key: str, compute: Callable[[], object]):
        if key in self._done:
            self.hits += 1
        else:
            self._done[key] = compute()
        return self._done[key]


def node_key(*nodes) -> str:
    """A stable key for config nodes (resolved where they resolve)."""
    plain = []
    for node in nodes:
        if OmegaConf.is_config(node):
            node = OmegaConf.to_container(node, resolve=True)
        plain.append(node)
    return json.dumps(plain, sort_keys=True, default=str)


def guarded(name: str, run: Callable[[], list[Check]]) -> list[Check]:
    """`run`'s rows; a user error becomes one FAIL row with its message, an unavailable
    download one SKIP row (offline, not cached), anything else one FAIL row naming it."""
    try:
        return run()
    except UNAVAILABLE as err:
        return [Check(name, SKIP, f"offline or not cached: {first_line(err)}")]
    except CalmLightningError as err:
        return [Check(name, FAIL, first_line(err))]
    except Exception as err:  # noqa: BLE001 (a check must report, never stop the others)
        return [Check(name, FAIL, f"{type(err).__name__}: {first_line(err)}")]


# ----- the checks -----
