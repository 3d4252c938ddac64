"""Step zero of a report: which jobs each sweep was asked to run, and what its folder holds.

A sweep folder keeps Hydra's `multirun.yaml` (the sweeper's grid and the command line's
overrides). Expanding it with Hydra's own basic sweeper gives the jobs the launch expected, in
job-number order; the job folders are named from `${hydra.job.num}` (conf/run.yaml), so job n
is the folder whose name starts with `n_`. A job is then finished (metrics.json), failed
(failed.json), unfinished (a folder without either: killed, timed out or still running),
unreadable (a record file that does not parse) or never started (no folder). Sweeps of other
sweepers (Optuna) have no fixed grid: their expected count is unknown and only what exists is
listed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from calm_lightning.runtime.sweep_grid import basic_sweeper_jobs

MULTIRUN_FILE = "multirun.yaml"


@dataclass
class SweepStatus:
    """What one sweep folder holds against what its launch expected."""

    folder: Path
    expected: int | None  # None: the grid is unknown (not Hydra's basic sweeper)
    finished: list[Path] = field(default_factory=list)
    failed: list[Path] = field(default_factory=list)
    unfinished: list[Path] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    never_started: list[str] = field(default_factory=list)  # the jobs' overrides

    @property
    def complete(self) -> bool:
        return self.expected is not None and len(self.finished) == self.expected

    def line(self, relative_to: Path | None = None) -> str:
        """The sweep in one line; its folder relative to `relative_to` when given (a report
        names the sweep from its own folder, never by the machine's path)."""
        total = "?" if self.expected is None else str(self.expected)
        parts = [f"{len(self.finished)} of {total} finished"]
        for label, items in (
            ("failed", self.failed),
            ("unfinished", self.unfinished),
            ("unreadable", self.unreadable),
            ("never started", self.never_started),
        ):
            if items:
                parts.append(f"{len(items)} {label}")
        folder = self.folder if relative_to is None else relative_path(self.folder, relative_to)
        return f"`{folder}`: " + ", ".join(parts)


def relative_path(path: str | Path, start: str | Path) -> str:
    """`path` as seen from the folder `start` (both resolved first)."""
    return os.path.relpath(Path(path).resolve(), Path(start).resolve())


def expected_jobs(sweep_dir: Path) -> list[list[str]] | None:
    """Every job's overrides as the launch expanded them (None when that is unknown)."""
    from omegaconf import OmegaConf

    try:
        tree = OmegaConf.to_container(OmegaConf.load(sweep_dir / MULTIRUN_FILE), resolve=False)
        sweeper, overrides = tree["hydra"]["sweeper"], tree["hydra"]["overrides"]
        if not str(sweeper.get("_target_", "")).endswith("BasicSweeper"):
            return None
        return basic_sweeper_jobs(sweeper.get("params") or {}, overrides.get("task") or [])
    except Exception:  # noqa: BLE001 (a damaged or foreign multirun.yaml: grid unknown)
        return None


def sweep_status(sweep_dir: Path, runs_by_path: dict, unreadable: dict) -> SweepStatus:
    """`runs_by_path`: every readable run by folder (a job's second copy included);
    `unreadable`: folder -> why."""
    jobs = expected_jobs(sweep_dir)
    status = SweepStatus(sweep_dir, None if jobs is None else len(jobs))
    folders = sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name[:1].isdigit())
    by_number: dict[int, Path] = {}
    for folder in folders:
        number = folder.name.split("_", 1)[0]
        if number.isdigit():
            by_number.setdefault(int(number), folder)
        if folder in unreadable:
            status.unreadable.append((folder, unreadable[folder]))
            continue
        run = runs_by_path.get(folder)
        if run is None:  # no readable config yet: the job was cut before it wrote one
            status.unfinished.append(folder)
        elif not run.error:
            status.finished.append(folder)
        elif run.failed:
            status.failed.append(folder)
        else:
            status.unfinished.append(folder)
    if jobs is not None:
        status.never_started = [" ".join(job) for n, job in enumerate(jobs) if n not in by_number]
    return status


def sweep_folders(roots: list[str | Path]) -> list[Path]:
    """Every folder below `roots` that holds a multirun.yaml."""
    found = []
    for root in roots:
        root = Path(root)
        found += [p.parent for p in sorted(root.rglob(MULTIRUN_FILE))]
    return found
