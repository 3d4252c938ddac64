"""Step one of a report: every run directory below the given roots, read through the run
record (run_record.py: its config, metrics, failure and retention rows) into a `Run` with a
flattened config, and mark as hyper-parameters the config keys that differ within each
(model, setting, method) group, leaving out seeds, paths and keys interpolated from the seed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from calm_lightning.runtime.run_record import find_runs

IGNORED_KEYS = ("paths.", "hydra.", "trainer.default_root_dir", "logger.", "callbacks.", "seed")


@dataclass
class Run:
    path: Path
    model: str
    method: str
    setting: str
    seed: int
    config: dict
    metrics: dict | None = None
    base: dict | None = None
    error: str | None = None
    params: dict = field(default_factory=dict)
    retention: dict | None = None  # retention.json's rows (base, method): task -> metrics


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node if not isinstance(node, list) else tuple(node)}


def collect_runs(roots: list[str | Path]) -> list[Run]:
    """Every run directory below `roots`, finished or not."""
    runs = []
    for record in find_runs(roots):
        flat = _flatten(OmegaConf.to_container(record.config))
        run = Run(
            record.path,
            flat.get("model.name", "?"),
            flat.get("method.name", "?"),
            flat.get("setting.name", "?"),
            int(flat.get("seed", 0)),
            flat,
            metrics=record.metrics,
            base=record.comparison.get("base"),
            error=record.error,
            retention=(record.retention or {}).get("rows"),
        )
        runs.append(run)
    _mark_swept_parameters(runs)
    return runs


def _mark_swept_parameters(runs: list[Run]) -> None:
    """A run's hyper-parameters = the config keys that differ within its (model, setting,
    method) group, seeds and paths excluded."""
    groups = defaultdict(list)
    for run in runs:
        groups[(run.model, run.setting, run.method)].append(run)
    for members in groups.values():
        keys = set().union(*(m.config for m in members))
        varying = sorted(
            k
            for k in keys
            if not k.startswith(IGNORED_KEYS)
            and len({repr(m.config.get(k)) for m in members}) > 1
            and not _follows_seed(k, members)
        )
        for member in members:
            member.params = {k: member.config.get(k) for k in varying}


def _follows_seed(key: str, members: list[Run]) -> bool:
    """Keys interpolated from `${seed}` (a method's or a data split's seed) vary with the seed
    and are not hyper-parameters: runs that differ only there are seeds of one setting."""
    return all(m.config.get(key) == m.seed for m in members)
