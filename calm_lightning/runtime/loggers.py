"""Loggers of a run: built from the `logger` group (csv, wandb, none), the final results
published to W&B (summary, the config's public part, reliability diagram, per-example table),
and closed so the next job of a multirun starts clean."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from calm_lightning.config_rules import Either, Flag, Number, OneOf, Text
from calm_lightning.runtime.run_record import (
    RunResult,
    read_wandb_id,
    run_dir_of_checkpoint,
    write_wandb_id,
)

# The W&B key of a run's reliability diagram (the sweep dashboard's media panel reads it).
RELIABILITY_KEY = "reliability"

# The keys of the `logger` group (conf/logger/*.yaml) with the values Lightning's CSVLogger and
# WandbLogger (and wandb.init, which receives `resume`) accept.
LOGGER_RULES = {
    "csv.save_dir": Text(),
    "csv.name": Text(optional=True),
    "csv.version": Either((Number(minimum=0, integer=True), OneOf(("",)), Text()), optional=True),
    "wandb.project": Text(optional=True),
    "wandb.entity": Text(optional=True),
    "wandb.name": Text(optional=True),
    "wandb.group": Text(optional=True),
    "wandb.save_dir": Text(),
    "wandb.offline": Flag(),
    "wandb.id": Text(optional=True),
    "wandb.resume": OneOf(("allow", "must", "never", "auto", True, False), optional=True),
    "wandb.log_model": OneOf(("all", True, False)),
}


# What only says where a job's files are, not what it computes: W&B (a shared service) never
# receives these, and any other local path only by its last name.
PRIVATE_KEYS = (
    "paths",
    "hydra",
    "logger",
    "callbacks",
    "ckpt_path",
    "trainer.default_root_dir",
    "evaluation.base_cache_dir",
)


def public_config(cfg: DictConfig) -> dict:
    """The resolved config as it may leave the machine: without PRIVATE_KEYS, and each local
    path (absolute or `~/...`) replaced by its file or folder name."""
    from calm_lightning.runtime.job_state import drop_keys

    tree = OmegaConf.to_container(cfg, resolve=True)
    drop_keys(tree, PRIVATE_KEYS)
    return _names_for_paths(tree)


def _names_for_paths(node):
    if isinstance(node, dict):
        return {key: _names_for_paths(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_names_for_paths(value) for value in node]
    if isinstance(node, str) and len(node) > 1 and (os.path.isabs(node) or node[0] == "~"):
        return Path(node).name
    return node


def _wandb_overrides(cfg: DictConfig, node: DictConfig, resume_from: str | None) -> dict:
    """Run id kept in the output dir (a resumed run continues the same W&B run) and, in a
    multirun, a group named after the sweep."""
    out = Path(cfg.paths.output_dir)
    extra: dict = {}
    if not node.get("id"):
        # A resumed run's id is in the run dir its checkpoint belongs to; a DDP child's in
        # the run dir rank 0 has just written it to.
        run_id = (resume_from and read_wandb_id(run_dir_of_checkpoint(resume_from))) or (
            read_wandb_id(out)
        )
        if not run_id:
            import secrets

            # W&B run ids are short lowercase alphanumerics; any unique such string works.
            run_id = secrets.token_hex(4)
        from calm_lightning.runtime.distributed import is_main_process

        if is_main_process():  # DDP children start later and read rank 0's id
            write_wandb_id(out, run_id)
        extra["id"] = run_id
    if not node.get("group"):
        from calm_lightning.runtime.multirun import in_multirun

        if in_multirun():
            from hydra.core.hydra_config import HydraConfig

            extra["group"] = Path(HydraConfig.get().sweep.dir).name
        else:
            extra["group"] = cfg.setting.name
    return extra


def build_loggers(cfg: DictConfig, resume_from: str | None = None) -> list:
    """The configured loggers; a W&B run resumed from a checkpoint keeps its run id."""
    loggers = []
    for node in (cfg.get("logger") or {}).values():
        if not node:
            continue
        is_wandb = str(node.get("_target_", "")).endswith("WandbLogger")
        loggers.append(
            instantiate(node, **(_wandb_overrides(cfg, node, resume_from) if is_wandb else {}))
        )
    return loggers


def publish_results(loggers: list, cfg: DictConfig, result: RunResult) -> None:
    """For each W&B logger: final metrics into the run summary, the resolved config's public
    part (`public_config`: no local path), the reliability diagram as an image and the
    per-example predictions as a table. The csv logger needs nothing more (Lightning wrote its
    rows)."""
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":
            continue
        import wandb

        # Nested, as W&B shows it (columns `method.module.upper_lr`) and as its saved views
        # address config values (`config:method.value.module.upper_lr`, the sweep dashboard).
        logger.log_hyperparams(public_config(cfg))
        run = logger.experiment
        for method, metrics in result.comparison.items():
            run.summary.update({f"{method}/{k}": v for k, v in metrics.items()})
        # W&B uploads the diagram from the file the run wrote (it stores images as files).
        run.log({RELIABILITY_KEY: wandb.Image(str(result.reliability_plot))})
        rows_json = result.predictions
        columns = list(rows_json[0]) if rows_json else []
        # Lists (option probabilities, samples, clusters) go in as JSON text cells.
        table = wandb.Table(
            columns=columns,
            data=[
                [json.dumps(v) if isinstance(v, list | dict) else v for v in r.values()]
                for r in rows_json
            ],
        )
        run.log({"predictions": table})


def finish_loggers(loggers: list) -> None:
    """Close loggers so the next job of a multirun starts clean (W&B needs an explicit finish)."""
    for logger in loggers:
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and hasattr(experiment, "finish"):
            experiment.finish()
