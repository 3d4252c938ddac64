"""Step one of a report: every run directory below the given roots, read through the run
record (run_record.py: its config, metrics, failure and retention rows) into a `Run` with a
flattened config, and mark as hyper-parameters the config keys that differ within each
(model, setting, method) group, leaving out seeds, paths and keys interpolated from the seed.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from calm_lightning.method_traits import UNLISTED_POSITION
from calm_lightning.runtime.job_state import IDENTITY_FILE
from calm_lightning.runtime.run_record import (
    CONFIG_FILE,
    FAILED_FILE,
    METRICS_FILE,
    RETENTION_FILE,
    read_run,
)

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
    heldout: dict | None = None  # metrics.json's `heldout` (the held-out split's metrics)
    failed: bool = False  # it wrote failed.json (else an error means: not finished)
    # What its method declares (method.traits; runs saved before traits: listed last, no panels)
    table_position: int = UNLISTED_POSITION
    step_series: tuple[str, ...] = ()


def _flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            out.update(_flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: node if not isinstance(node, list) else tuple(node)}


@dataclass
class Collection:
    """What the roots hold: readable runs (one per job), folders whose records do not parse,
    the same job found twice, and each sweep's completeness (reporting/completeness.py)."""

    runs: list[Run]
    unreadable: dict[Path, str] = field(default_factory=dict)
    duplicates: list[tuple[Path, Path]] = field(default_factory=list)  # (kept, left out)
    sweeps: list = field(default_factory=list)  # SweepStatus per sweep folder


def collect_runs(roots: list[str | Path]) -> list[Run]:
    """Every readable run directory below `roots`, finished or not, each job once."""
    return collect(roots).runs


def collect(roots: list[str | Path]) -> Collection:
    """Every run directory below `roots`: a record that does not parse is listed (with the
    file and why), never a crash; one job (the same config digest) found in two folders is
    one run, the finished copy kept; every sweep folder's expected jobs are checked."""
    from calm_lightning.reporting.completeness import sweep_folders, sweep_status

    collection, by_digest, readable = Collection([]), {}, {}
    folders = [p.parent for root in roots for p in sorted(Path(root).rglob(CONFIG_FILE))]
    for folder in folders:
        try:
            run, digest = _read(folder)
        except Exception as err:  # noqa: BLE001 (any damaged record is listed, not fatal)
            collection.unreadable[folder] = _why_unreadable(folder, err)
            continue
        readable[folder] = run
        kept = by_digest.get(digest) if digest else None
        if kept is None:
            if digest:
                by_digest[digest] = run
            collection.runs.append(run)
            continue
        if run.metrics and not kept.metrics:  # the finished copy is the one that counts
            collection.runs[collection.runs.index(kept)] = by_digest[digest] = run
            kept, run = run, kept
        collection.duplicates.append((kept.path, run.path))
    _mark_swept_parameters(collection.runs)
    collection.sweeps = [
        sweep_status(folder, readable, collection.unreadable) for folder in sweep_folders(roots)
    ]
    return collection


def _read(folder: Path) -> tuple[Run, str | None]:
    record = read_run(folder)
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
        heldout=(record.summary or {}).get("heldout"),
        failed=record.failure is not None,
        table_position=int(flat.get("method.traits.table_position", UNLISTED_POSITION)),
        step_series=tuple(flat.get("method.traits.step_series", ())),
    )
    identity = folder / IDENTITY_FILE
    digest = json.loads(identity.read_text()).get("digest") if identity.is_file() else None
    return run, digest


def _why_unreadable(folder: Path, err: Exception) -> str:
    """The first record file of `folder` that does not parse, and the parser's complaint."""
    for name in (CONFIG_FILE, METRICS_FILE, FAILED_FILE, RETENTION_FILE, IDENTITY_FILE):
        path = folder / name
        if not path.is_file():
            continue
        try:
            text = path.read_text()
            OmegaConf.create(text) if name.endswith(".yaml") else json.loads(text)
        except Exception as file_err:  # noqa: BLE001
            return f"{path}: {type(file_err).__name__}: {file_err}".splitlines()[0]
    return f"{folder}: {type(err).__name__}: {err}".splitlines()[0]


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
