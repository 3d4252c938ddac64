"""Step one of a report: find every run directory (one holding `config_resolved.yaml`) below the
given roots, read its flattened config and its `metrics.json` (or `failed.json`, and
`retention.json` when the run measured retention) into a `Run`,
and mark as hyper-parameters the config keys that differ within each (model, setting, method)
group, leaving out seeds, paths and keys interpolated from the seed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

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
    """Every run directory below `roots` (a dir holding config_resolved.yaml), finished or not."""
    runs = []
    for root in roots:
        for config_path in sorted(Path(root).rglob("config_resolved.yaml")):
            run_dir = config_path.parent
            config = OmegaConf.to_container(OmegaConf.load(config_path))
            flat = _flatten(config)
            run = Run(
                run_dir,
                flat.get("model.name", "?"),
                flat.get("method.name", "?"),
                flat.get("setting.name", "?"),
                int(flat.get("seed", 0)),
                flat,
            )
            metrics_file, failed_file = run_dir / "metrics.json", run_dir / "failed.json"
            if metrics_file.is_file():
                payload = json.loads(metrics_file.read_text())
                run.metrics = payload["metrics"]
                run.base = (payload.get("comparison") or {}).get("base")
            elif failed_file.is_file():
                run.error = json.loads(failed_file.read_text()).get("error", "failed")
            else:
                run.error = "no metrics.json (interrupted or still running)"
            retention_file = run_dir / "retention.json"
            if retention_file.is_file():
                run.retention = json.loads(retention_file.read_text()).get("rows")
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
