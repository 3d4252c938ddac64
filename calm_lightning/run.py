"""Entry point: `python -m calm_lightning.run [group=option ...] [key=value ...]`."""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from calm_lightning.config import in_multirun  # importing config registers the resolvers

log = logging.getLogger(__name__)
FAILED_FILE = "failed.json"


@hydra.main(version_base="1.3", config_path="conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns the sweep objective (conf-ECE, penalised below the accuracy bar).

    In a multirun a failing job is recorded in its output dir (failed.json) and the sweep goes
    on with the next job; a single run fails loudly.
    """
    from calm_lightning.pipeline import run_experiment

    try:
        metrics = run_experiment(cfg)
    except Exception as err:
        if not in_multirun():
            raise
        out = Path(cfg.paths.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / FAILED_FILE).write_text(
            json.dumps(
                {
                    "error": f"{type(err).__name__}: {err}",
                    "traceback": traceback.format_exc(),
                },
                indent=2,
            )
        )
        log.error("job failed, the sweep continues: %s: %s", type(err).__name__, err)
        return None
    return sweep_objective(cfg, metrics)


def sweep_objective(cfg: DictConfig, metrics: dict) -> float:
    """conf-ECE (Sem-ECE on open-ended QA), plus 1 when accuracy falls to or below
    `min_accuracy_ratio` x the base model's accuracy measured in the same run (the paper's
    selection rule as one number)."""
    objective = float(metrics["sem_ece"] if "sem_ece" in metrics else metrics["conf_ece"])
    payload = json.loads((Path(cfg.paths.output_dir) / "metrics.json").read_text())
    base = (payload.get("comparison") or {}).get("base")
    ratio = float(cfg.evaluation.get("min_accuracy_ratio", 0.8))
    if base and metrics["accuracy"] <= ratio * base["accuracy"]:
        objective += 1.0
    return objective


if __name__ == "__main__":
    main()
