"""Entry point: `python -m calm_lightning.run [group=option ...] [key=value ...]`."""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from calm_lightning import config  # noqa: F401  (registers the config resolvers)


@hydra.main(version_base="1.3", config_path="conf", config_name="run")
def main(cfg: DictConfig) -> float | None:
    """Run one job; returns conf-ECE so Hydra sweepers can minimise it."""
    from calm_lightning.pipeline import run_experiment

    metrics = run_experiment(cfg)
    return metrics.get("conf_ece")


if __name__ == "__main__":
    main()
