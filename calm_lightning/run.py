"""Entry point: `python -m calm_lightning.run [group=option ...] [key=value ...]`."""

from __future__ import annotations

import json
import logging
import traceback
from pathlib import Path

import hydra
from omegaconf import DictConfig

from calm_lightning import config  # noqa: F401  (registers the config resolvers)

log = logging.getLogger(__name__)
FAILED_FILE = "failed.json"


def _in_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


@hydra.main(version_base="1.3", config_path="conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns conf-ECE so Hydra sweepers can minimise it.

    In a multirun a failing job is recorded in its output dir (failed.json) and the sweep goes
    on with the next job; a single run fails loudly.
    """
    from calm_lightning.pipeline import run_experiment

    try:
        metrics = run_experiment(cfg)
    except Exception as err:
        if not _in_multirun():
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
    return metrics.get("conf_ece")


if __name__ == "__main__":
    main()
