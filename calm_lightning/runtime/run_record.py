"""The run record: what one run leaves in its folder, written once and read back one way.

Every file name of a run directory is defined here and nowhere else. The pipeline builds a
`RunResult` in memory and hands it to `write_run` once at the end (the result files of each
evaluated row are written as soon as that row is scored, so an interrupted run keeps what it
measured); a failing sweep job leaves `write_failure`'s record instead. Everything that reads a
run afterwards (report, export, retention, the model card, benchmarks) goes through
`read_run` / `find_runs`, so a change of layout is a change of this module.

This module is low level on purpose: it imports nothing from methods/, evaluation/ or models/.

A run directory::

    config_resolved.yaml   the composed, resolved config (written first)
    metrics.json           the method's metrics, every compared row, timings, what was fitted
    predictions.jsonl      one line per test question
    reliability.png        the reliability diagram of the test split
    data_summary.json      which files were read, how many items, truncations
    base/                  the untouched model's metrics.json, predictions.jsonl, reliability.png
    calibration/           what calibration changed (adapter/, head, calibrated_lm.json)
    retention.json         lm-eval retention rows, when measured; retention/ its task outputs
    checkpoints/           Lightning checkpoints (last.ckpt; last-good.ckpt before a NaN stop)
    wandb_id.txt           the W&B run id, so a resumed run continues the same W&B run
    failed.json            (multirun) why the job failed

A sweep's (or single run's) cache of base rows (evaluation/base_cache.py)::

    base_cache/<kind>-<digest>/   one entry: cache_entry.json (fingerprint, payload) and the
                                  row's files (base: metrics.json, predictions.jsonl,
                                  reliability.png; retention_base: each task's samples)
"""

from __future__ import annotations

import json
import os
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from calm_lightning.errors import CalmLightningError

CONFIG_FILE = "config_resolved.yaml"
METRICS_FILE = "metrics.json"
PREDICTIONS_FILE = "predictions.jsonl"
RELIABILITY_FILE = "reliability.png"
DATA_SUMMARY_FILE = "data_summary.json"
FAILED_FILE = "failed.json"
RETENTION_FILE = "retention.json"
RETENTION_DIR = "retention"  # lm-eval's generated task configs and per-sample outputs
BASE_DIR = "base"
CALIBRATION_DIR = "calibration"
CHECKPOINT_DIR = "checkpoints"
LAST_CHECKPOINT = "last.ckpt"
LAST_GOOD_CHECKPOINT = "last-good.ckpt"
WANDB_ID_FILE = "wandb_id.txt"
CALM_STEPS_PLOT = "calm_steps.png"
BASE_CACHE_DIR = "base_cache"  # in the sweep's folder (multirun) or the run's own
CACHE_ENTRY_FILE = "cache_entry.json"


_UMASK = os.umask(0)
os.umask(_UMASK)  # (reading the process's umask means setting it; it is put back at once)


class RunRecordError(CalmLightningError):
    """A folder that is not (or not yet) a finished run."""


@dataclass
class Evaluation:
    """One scored row in memory: its metrics.json payload and its predictions.jsonl lines."""

    summary: dict  # {"metrics": {...}, "model": ..., "method": ..., "option_tokens" | "task"}
    rows: list[dict]

    @property
    def metrics(self) -> dict:
        return self.summary["metrics"]


@dataclass
class RunResult:
    """What a run measured, in memory: the method's evaluation, every compared row (the
    untouched model's `base` first, when the method changes the model) and what else goes into
    metrics.json (timings, what calibration fitted, the applied method_setting)."""

    output_dir: Path
    evaluation: Evaluation
    comparison: dict[str, dict]
    extra: dict = field(default_factory=dict)
    data_summary: dict | None = None

    @property
    def metrics(self) -> dict:
        return self.evaluation.metrics

    @property
    def predictions(self) -> list[dict]:
        return self.evaluation.rows

    @property
    def reliability_plot(self) -> Path:
        return self.output_dir / RELIABILITY_FILE

    def summary(self) -> dict:
        """metrics.json's content."""
        return {**self.evaluation.summary, "comparison": self.comparison, **self.extra}


@contextmanager
def atomic_replace(path: str | Path) -> Iterator[Path]:
    """A temporary file in `path`'s folder (`.<name>.<random>`) for the block to write; it
    is fsynced and replaces `path` when the block ends, or is removed when the block fails. A
    reader never sees half a file, and a writer killed midway (or a machine that loses power
    just after the rename) leaves the old file or the whole new one, plus at most a stray
    temporary that the job's next start removes (runtime/job_state.py). Every record file,
    plot and checkpoint of a run is written through it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(handle)
    tmp = Path(name)
    try:
        yield tmp
        os.chmod(tmp, 0o666 & ~_UMASK)  # mkstemp makes it private; a run's files are not
        _fsync(tmp)  # the data on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent, directory=True)


def _fsync(path: Path, directory: bool = False) -> None:
    """Flush a file's data (or a folder's entries: the rename) to disk. Some filesystems
    refuse a folder's fsync; the rename is then as durable as they make it."""
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    except OSError:
        if directory:
            return
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not directory:
            raise
    finally:
        os.close(fd)


def write_text_atomic(path: str | Path, text: str) -> Path:
    """`text` into `path`, atomically (`atomic_replace`)."""
    with atomic_replace(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def _write_json(path: Path, payload) -> Path:
    return write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def write_config(directory: str | Path, cfg) -> Path:
    """config_resolved.yaml (the first file of a run: it is what marks a run directory)."""
    from omegaconf import OmegaConf

    return write_text_atomic(Path(directory) / CONFIG_FILE, OmegaConf.to_yaml(cfg, resolve=True))


def write_predictions(directory: str | Path, evaluation: Evaluation) -> Path:
    """predictions.jsonl of one evaluated row (written as soon as it is scored)."""
    lines = "".join(json.dumps(row) + "\n" for row in evaluation.rows)
    return write_text_atomic(Path(directory) / PREDICTIONS_FILE, lines)


def reliability_path(directory: str | Path) -> Path:
    """Where an evaluated row's reliability diagram goes (its folder created)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return directory / RELIABILITY_FILE


def write_row(directory: str | Path, evaluation: Evaluation) -> None:
    """A compared row's own complete record (e.g. base/): its metrics.json and predictions."""
    write_predictions(directory, evaluation)
    _write_json(Path(directory) / METRICS_FILE, evaluation.summary)


def write_run(result: RunResult) -> Path:
    """The run's one write of metrics.json (and data_summary.json), at the end of the run."""
    out = result.output_dir
    if result.data_summary is not None:
        _write_json(out / DATA_SUMMARY_FILE, result.data_summary)
    return _write_json(out / METRICS_FILE, result.summary())


def read_predictions(directory: str | Path) -> list[dict]:
    """predictions.jsonl of a folder (a compared row's, or a cache entry's)."""
    path = Path(directory) / PREDICTIONS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def write_cache_entry(directory: str | Path, payload: dict) -> Path:
    """A base-cache entry's own record (its fingerprint and payload)."""
    return _write_json(Path(directory) / CACHE_ENTRY_FILE, payload)


def read_cache_entry(directory: str | Path) -> dict | None:
    """A base-cache entry's record; None when there is no such entry."""
    return _read_json(Path(directory) / CACHE_ENTRY_FILE)


def write_failure(directory: str | Path, err: BaseException) -> Path:
    """failed.json: why a sweep job stopped (the sweep goes on with the next job)."""
    trace = "".join(traceback.format_exception(type(err), err, err.__traceback__))
    payload = {"error": f"{type(err).__name__}: {err}", "traceback": trace}
    return _write_json(Path(directory) / FAILED_FILE, payload)


def write_retention(directory: str | Path, payload: dict) -> Path:
    """retention.json (a run's, or a saved run's measured afterwards)."""
    return _write_json(Path(directory) / RETENTION_FILE, payload)


def checkpoint_file(run_dir: str | Path, name: str = LAST_CHECKPOINT) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / name


def run_dir_of_checkpoint(checkpoint: str | Path) -> Path:
    """The run directory a checkpoint file of `checkpoint_file` belongs to."""
    return Path(checkpoint).parent.parent


def write_wandb_id(run_dir: str | Path, run_id: str) -> None:
    write_text_atomic(Path(run_dir) / WANDB_ID_FILE, run_id)


def read_wandb_id(run_dir: str | Path) -> str | None:
    """The W&B run id an earlier process of this run chose (None when there is none)."""
    path = Path(run_dir) / WANDB_ID_FILE
    if not path.is_file():
        return None
    return path.read_text().strip() or None


@dataclass
class RunRecord:
    """A run directory as read back: its config, and whichever results it holds."""

    path: Path
    config: object  # the resolved config (DictConfig)
    summary: dict | None = None  # metrics.json; None while running or after a failure
    failure: dict | None = None  # failed.json
    retention: dict | None = None  # retention.json

    @property
    def finished(self) -> bool:
        return self.summary is not None

    @property
    def metrics(self) -> dict | None:
        return None if self.summary is None else self.summary["metrics"]

    @property
    def comparison(self) -> dict:
        return (self.summary or {}).get("comparison") or {}

    @property
    def error(self) -> str | None:
        """Why the run has no metrics: its failure, or that it was interrupted / is running."""
        if self.finished:
            return None
        if self.failure is not None:
            return self.failure.get("error", "failed")
        return f"no {METRICS_FILE} (interrupted or still running)"

    def get(self, key: str, default=None):
        """A value of the run's config by dotted key (`method.name`)."""
        from omegaconf import OmegaConf

        return OmegaConf.select(self.config, key, default=default)

    @property
    def calibration_dir(self) -> Path:
        return self.path / CALIBRATION_DIR

    @property
    def data_summary(self) -> dict | None:
        return _read_json(self.path / DATA_SUMMARY_FILE)

    def predictions(self, row: str | None = None) -> list[dict]:
        """predictions.jsonl of the method (or of a compared row's folder, e.g. "base")."""
        path = (self.path / row if row else self.path) / PREDICTIONS_FILE
        if not path.is_file():
            raise RunRecordError(f"{self.path} has no {path.relative_to(self.path)}")
        return [json.loads(line) for line in path.read_text().splitlines() if line]


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def is_run_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG_FILE).is_file()


def read_run(run_dir: str | Path) -> RunRecord:
    """The run in `run_dir`, finished or not; a folder without a config is refused."""
    from omegaconf import OmegaConf

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunRecordError(f"run_dir={run_dir}: no such run directory")
    if not is_run_dir(run_dir):
        raise RunRecordError(
            f"run_dir={run_dir} is not a run directory (no {CONFIG_FILE}); pass the folder a "
            "run wrote, e.g. outputs/runs/<model>/<method>/<setting>/<time>"
        )
    return RunRecord(
        path=run_dir,
        config=OmegaConf.load(run_dir / CONFIG_FILE),
        summary=_read_json(run_dir / METRICS_FILE),
        failure=_read_json(run_dir / FAILED_FILE),
        retention=_read_json(run_dir / RETENTION_FILE),
    )


def find_runs(roots) -> list[RunRecord]:
    """Every run directory below `roots` (a folder holding the run config), in path order."""
    return [read_run(p.parent) for root in roots for p in sorted(Path(root).rglob(CONFIG_FILE))]
