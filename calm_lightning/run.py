"""Entry point: `python -m calm_lightning.run [group=option ...] [key=value ...]`."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

import calm_lightning.runtime.resolvers  # noqa: F401  (importing it registers the resolvers)
from calm_lightning.errors import CalmLightningError
from calm_lightning.runtime.job_process import run_in_own_process
from calm_lightning.runtime.multirun import in_multirun
from calm_lightning.runtime.parallel import release_job_device, under_joblib

log = logging.getLogger(__name__)


# The config tree is the package `calm_lightning.conf` (top-level conf/ in the source tree,
# mapped into the package by pyproject.toml), found the same way in a checkout and a wheel.
@hydra.main(version_base="1.3", config_path="pkg://calm_lightning.conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    """Run one job (`run_job`). Under the parallel launcher (Hydra's joblib plugin) the job
    runs in a process of its own that the joblib worker waits for, so that a job killed by
    the out-of-memory killer fails alone instead of stopping the sweep
    (runtime/job_process.py)."""
    if under_joblib():
        return run_in_own_process("calm_lightning.run:run_job", cfg)
    return run_job(cfg)


def run_job(cfg: DictConfig) -> float | None:
    """One job; returns the sweep objective (conf-ECE, penalised below the accuracy bar).

    In a multirun a failing job is recorded in its output dir (failed.json) and the sweep goes
    on with the next job. A single run that fails on something the user can fix (a config
    value, a data file, a missing model or dataset) prints the message and its remedy without
    a traceback (HYDRA_FULL_ERROR=1 shows it); anything else fails loudly.
    """
    from calm_lightning.pipeline import run_experiment

    try:
        stored = finished_result(cfg)
    except CalmLightningError as err:  # another job's folder, a corrupt record: never mixed
        print(f"\nerror: {err}", file=sys.stderr)
        raise SystemExit(1) from None
    if stored is not None:  # a relaunched sweep: this job is done, nothing is loaded or written
        return sweep_objective(cfg, stored["metrics"], stored.get("comparison", {}))
    try:
        result = run_experiment(cfg)
    except Exception as err:
        if type(err).__module__.startswith("submitit"):
            raise  # the launcher's own (timeouts, requeues) are its to handle
        if in_multirun():
            _record_failure(cfg, err)
            return None
        if isinstance(err, CalmLightningError) and os.environ.get("HYDRA_FULL_ERROR") != "1":
            print(f"\nerror: {err}\n(HYDRA_FULL_ERROR=1 shows the traceback)", file=sys.stderr)
            raise SystemExit(1) from None
        raise
    finally:
        release_job_device()  # a parallel sweep's next job may take this job's GPU
    return sweep_objective(cfg, result.metrics, result.comparison)


def finished_result(cfg: DictConfig) -> dict | None:
    """metrics.json of this very job (same config digest) in its folder, when it finished."""
    from calm_lightning.runtime.job_state import JobFolder

    job = JobFolder(cfg)
    if not job.path.is_dir():
        return None
    job.check_identity()
    summary = job.finished_summary()
    if summary is not None:
        log.info("already finished in %s: its metrics are returned, nothing is rerun", job.path)
        print(f"{job.path}: finished earlier (metrics.json), not rerun")
    return summary


def _record_failure(cfg: DictConfig, err: Exception) -> None:
    from calm_lightning.runtime.run_record import CONFIG_FILE, write_config, write_failure

    out = Path(cfg.paths.output_dir)
    if not (out / CONFIG_FILE).is_file():
        # A job refused by the config check stops before the pipeline writes its config; the
        # sweep's report finds a job by that file, so the failed job gets one here.
        try:
            write_config(out, cfg)
        except Exception as config_err:  # a value that does not even resolve
            log.warning("no %s for the failed job: %s", CONFIG_FILE, config_err)
    write_failure(out, err)
    log.error("job failed, the sweep continues: %s: %s", type(err).__name__, err)


def sweep_objective(cfg: DictConfig, metrics: dict, comparison: dict) -> float:
    """conf-ECE (Sem-ECE on open-ended QA), plus 1 when accuracy falls to or below
    `min_accuracy_ratio` x the base model's accuracy measured in the same run (the paper's
    selection rule as one number)."""
    objective = float(metrics["sem_ece"] if "sem_ece" in metrics else metrics["conf_ece"])
    base = comparison.get("base")
    ratio = float(cfg.evaluation.get("min_accuracy_ratio", 0.8))
    if base and metrics["accuracy"] <= ratio * base["accuracy"]:
        objective += 1.0
    return objective


if __name__ == "__main__":
    main()
