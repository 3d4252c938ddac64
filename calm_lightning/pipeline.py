"""The plain `run_experiment(cfg)` behind `python -m calm_lightning.run` (tests call it too).

It only orchestrates: compose (the resolved config and what a method_setting file changed) ->
seed -> build (data read and validated first, then the model and the method) -> calibrate (the
method's own protocol, methods/base.py) -> evaluate -> write. What a method is, needs and does
lives in its class; W&B lives in loggers.py.
"""

from __future__ import annotations

import gc
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from calm_lightning.distributed import is_main_process
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.results import format_table, run_meta
from calm_lightning.evaluation.retention import (
    RETENTION_DIR,
    RETENTION_FILE,
    RetentionSettings,
    evaluate_retention,
    format_retention_table,
    load_tasks,
    write_retention,
)
from calm_lightning.loggers import build_loggers, finish_loggers, publish_results
from calm_lightning.method_settings import applied_method_setting, log_method_setting
from calm_lightning.methods.base import CalibrationMethod
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.loading import LoadedModel, load_language_model
from calm_lightning.resolvers import in_multirun
from calm_lightning.timing import Stopwatch

# Manual-optimization methods (CALM) checkpoint the state after their update on purpose: a
# checkpoint at outer step k holds the parameters and counter after step k, which is what a
# resume needs. Lightning warns that it cannot save a pre-update state; that is not wanted.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


@dataclass
class RunResult:
    """What a run measured: the method's test metrics and every evaluated row (the untouched
    model's `base` row first, when the method changes the model)."""

    metrics: dict
    comparison: dict[str, dict]
    output_dir: Path


def method_class(cfg: DictConfig) -> type[CalibrationMethod]:
    """The class `method.module._target_` names (its requirements are class attributes)."""
    cls = get_class(cfg.method.module._target_)
    if not (isinstance(cls, type) and issubclass(cls, CalibrationMethod)):
        raise ConfigError(f"method.module._target_={cls!r} is not a CalibrationMethod")
    return cls


def build_datamodule(cfg: DictConfig, tokenizer=None):
    """The setting's data module (sources instantiated from `setting.train/heldout/test`;
    nothing is read until `load_records` or a loader asks)."""
    from calm_lightning.data.datamodule import CalibrationDataModule

    setting = cfg.setting
    sources = {
        split: instantiate(setting[split]) if setting.get(split) is not None else None
        for split in ("train", "heldout", "test")
    }
    return CalibrationDataModule(
        tokenizer=tokenizer,
        batch_size=setting.batch_size,
        heldout_batch_size=setting.get("heldout_batch_size"),
        eval_batch_size=setting.eval_batch_size,
        max_length=setting.max_length,
        eval_max_length=setting.eval_max_length,
        num_workers=setting.num_workers,
        seed=cfg.seed,
        mcqa_format=cfg.evaluation.get("scoring", "letter"),
        cloze_prompt=cfg.evaluation.get("cloze", {}).get("prompt", "chat"),
        **sources,
    )


def build_method(cfg: DictConfig, loaded: LoadedModel) -> CalibrationMethod:
    """The method's LightningModule on the loaded LM, with the shared evaluation options."""
    cls = method_class(cfg)
    head = cfg.method.get("head")
    model = cls.build_model(
        loaded,
        OmegaConf.to_container(cfg.peft, resolve=True),
        OmegaConf.to_container(head, resolve=True) if head else None,
    )
    return instantiate(
        cfg.method.module,
        model=model,
        tokenizer=loaded.tokenizer,
        option_tokens=cfg.evaluation.option_tokens,
        probe_size=cfg.evaluation.probe_size,
        n_bins=cfg.evaluation.n_bins,
        openqa=cfg.evaluation.openqa,
        scoring=cfg.evaluation.get("scoring", "letter"),
        cloze=cfg.evaluation.get("cloze"),
        _convert_="all",
    )


def checkpoint_path(cfg: DictConfig) -> str | None:
    """`ckpt_path` may name a checkpoint file or a run directory (its checkpoints/last.ckpt)."""
    value = cfg.get("ckpt_path")
    if not value:
        return None
    path = Path(str(value)).expanduser()
    if path.is_dir():
        path = path / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise ConfigError(f"ckpt_path={value}: no checkpoint at {path}")
    return str(path)


def evaluate(trainer, module, datamodule, out: Path, cfg: DictConfig, method_name: str) -> dict:
    """Score the test split with the module as it is now and write its result files (under
    DDP every process scores its share; the gathered predictions are written once)."""
    trainer.test(module, datamodule=datamodule, verbose=False)
    metrics = module.predictions.report(cfg.evaluation.n_bins)
    if is_main_process():
        meta = {**run_meta(cfg), "method": method_name}
        title = f"{cfg.model.name} / {method_name} / {cfg.setting.name}"
        module.predictions.write(out, metrics, meta, title=title)
    return metrics


def check_world_size(trainer, retention: RetentionSettings) -> None:
    """Refuse what does not run on several processes yet, before any work starts."""
    if trainer.world_size == 1:
        return
    environment = getattr(trainer.strategy, "cluster_environment", None)
    if in_multirun() and not getattr(environment, "creates_processes_externally", False):
        raise ConfigError(
            f"--multirun with {trainer.world_size} processes per job on this machine: "
            "Lightning starts the other processes by re-running the command line, which would "
            "start the whole sweep again. Run the jobs one at a time (a loop over single "
            "runs), or launch them through SLURM: hydra/launcher=slurm_ddp (docs/scaling.md)"
        )
    if retention.enabled:
        raise ConfigError(
            "evaluation.retention runs lm-eval on one process: with "
            f"{trainer.world_size} processes, drop evaluation.retention.tasks and run "
            "`python -m calm_lightning.retention run_dir=<this run>` afterwards"
        )


def run_experiment(cfg: DictConfig) -> RunResult:
    """Run one (model, method, setting): compose, seed, build, calibrate, evaluate, write."""
    # compose: the resolved config and whatever a method_setting file changed, said up front
    out = Path(cfg.paths.output_dir)
    main = is_main_process()  # under DDP only rank 0 writes files and prints the tables
    out.mkdir(parents=True, exist_ok=True)
    method_setting = applied_method_setting(cfg)
    if main:
        OmegaConf.save(cfg, out / "config_resolved.yaml", resolve=True)
        log_method_setting(method_setting)
    # seed
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    # build: every data source is read and validated before any model is loaded
    cls = method_class(cfg)
    datamodule = build_datamodule(cfg)
    cls.check_requirements(cfg, datamodule.sources)
    ckpt_path = checkpoint_path(cfg)
    datamodule.load_records()
    # lm-eval's retention tasks read their data now too, before the model loads.
    retention = RetentionSettings.from_config(cfg.evaluation.get("retention"))
    retention_tasks = load_tasks(retention, out / RETENTION_DIR) if retention.enabled else {}
    retention_rows: dict[str, dict] = {}
    stopwatch = Stopwatch()
    loggers: list = []
    module = None
    try:
        with stopwatch.phase("load_model"):
            loaded = load_language_model(cfg.model)
        datamodule.tokenizer = loaded.tokenizer
        module = build_method(cfg, loaded)
        loggers = build_loggers(cfg, resume_from=ckpt_path)
        callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node]
        trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks)
        check_world_size(trainer, retention)
        rows: dict[str, dict] = {}
        if module.changes_model and cfg.evaluation.get("compare_with_base", True):
            # Before calibration the adapters are zero and the head is the identity: this is
            # exactly the untouched model, scored on the same data by the same code.
            with stopwatch.phase("evaluate_base"):
                rows["base"] = evaluate(trainer, module, datamodule, out / "base", cfg, "base")
        if retention_tasks:
            # The untouched model: no head, the adapters (zero before calibration) inert.
            with stopwatch.phase("retention_base"):
                retention_rows["base"] = evaluate_retention(
                    CalibratedLM(module.model.lm, None),
                    loaded.tokenizer,
                    retention_tasks,
                    retention,
                    out / RETENTION_DIR / "base",
                )
        # calibrate
        with stopwatch.phase("calibrate"):
            fitted = module.calibrate(trainer, datamodule, ckpt_path)
        if module.changes_model and main:
            module.save_calibration(out / "calibration")
        # evaluate
        with stopwatch.phase("evaluate"):
            metrics = evaluate(trainer, module, datamodule, out, cfg, cfg.method.name)
        rows[cfg.method.name] = metrics
        if retention_tasks and module.changes_model:
            with stopwatch.phase("retention"):
                retention_rows[cfg.method.name] = evaluate_retention(
                    module.model,
                    loaded.tokenizer,
                    retention_tasks,
                    retention,
                    out / RETENTION_DIR / cfg.method.name,
                )
        # write
        if not main:
            return RunResult(metrics=metrics, comparison=rows, output_dir=out)
        _add_to_metrics_file(
            out,
            {
                "comparison": rows,
                "timings": stopwatch.seconds,
                **fitted,
                "method_setting": method_setting,
            },
        )
        publish_results(loggers, cfg, out, rows)
        datamodule.write_summary(out)
        print(
            f"\n{cfg.model.name} / {cfg.setting.name}  (n = {metrics['n']} test questions, "
            f"outputs in {out})"
        )
        print(format_table(rows))
        if retention_rows:
            write_retention(out, retention_rows, retention, run_meta(cfg))
            print(f"\nretention (lm-eval, zero-shot; {out / RETENTION_FILE})")
            print(format_retention_table(retention_rows))
        return RunResult(metrics=metrics, comparison=rows, output_dir=out)
    finally:
        finish_loggers(loggers)
        del module
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _add_to_metrics_file(out: Path, record: dict) -> None:
    """Add the comparison rows, wall times, what calibration fitted (e.g. T) and the applied
    method_setting to the metrics.json the evaluation wrote."""
    path = out / "metrics.json"
    payload = json.loads(path.read_text())
    payload.update(record)
    path.write_text(json.dumps(payload, indent=2))
