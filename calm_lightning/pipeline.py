"""The plain `run_experiment(cfg)` behind `python -m calm_lightning.run` (tests call it too).

It only orchestrates: validate (every config value, validation.py, before anything
is written or read) -> compose (the resolved config and what a method_setting file changed) ->
build (data read and checked, the trainer, then the model and the method) -> calibrate (the
method's own protocol, methods/base.py) -> evaluate (test split, and lm-eval retention when
asked) -> write (the run record, runtime/run_record.py). What a method is, needs and does
lives in its class.
"""

from __future__ import annotations

import gc
import warnings

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from calm_lightning.evaluation.heldout_pass import heldout_metrics
from calm_lightning.evaluation.lm_eval_retention import RetentionStep
from calm_lightning.evaluation.results import format_table, run_meta
from calm_lightning.evaluation.scorers import MCQAScorer, scorer_from_config
from calm_lightning.evaluation.scoring_pass import base_rows, evaluate
from calm_lightning.methods.base import CalibrationMethod, method_class
from calm_lightning.models.loading import LoadedModel, load_language_model, load_tokenizer
from calm_lightning.models.logit_distortion import (
    LogitDistortion,
    distortion_settings,
    resolve_distortion,
)
from calm_lightning.runtime.checkpointing import claimed_job, job_callbacks, lightning_plugins
from calm_lightning.runtime.distributed import is_main_process
from calm_lightning.runtime.job_device import set_job_device
from calm_lightning.runtime.loggers import build_loggers, finish_loggers, publish_results
from calm_lightning.runtime.method_settings import applied_method_setting, log_method_setting
from calm_lightning.runtime.run_record import (
    CALIBRATION_DIR,
    RETENTION_FILE,
    RunResult,
    write_config,
    write_retention,
    write_run,
)
from calm_lightning.runtime.strategies import uses_fsdp
from calm_lightning.runtime.timing import Stopwatch
from calm_lightning.validation import check_world_size, validate_config

# Manual-optimization methods (CALM) checkpoint the state after their update on purpose: a
# checkpoint at outer step k holds the parameters and counter after step k, which is what a
# resume needs. Lightning warns that it cannot save a pre-update state; that is not wanted.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


def build_sources(cfg: DictConfig) -> dict:
    """The setting's data sources (`setting.train/heldout/test`; nothing is read yet)."""
    setting = cfg.setting
    return {
        split: instantiate(setting[split]) if setting.get(split) is not None else None
        for split in ("train", "heldout", "test")
    }


def build_datamodule(
    cfg: DictConfig, scorer: MCQAScorer, tokenizer=None, sources: dict | None = None
):
    """The setting's data module (nothing is read until `load_records` or a loader asks); the
    run's MCQA scorer says how MCQA records train."""
    from calm_lightning.data.datamodule import CalibrationDataModule

    setting = cfg.setting
    sources = build_sources(cfg) if sources is None else sources
    return CalibrationDataModule(
        tokenizer=tokenizer,
        batch_size=setting.batch_size,
        heldout_batch_size=setting.get("heldout_batch_size"),
        eval_batch_size=setting.eval_batch_size,
        max_length=setting.max_length,
        eval_max_length=setting.eval_max_length,
        num_workers=setting.num_workers,
        seed=cfg.seed,
        epoch_batches=cfg.method.get("epoch_batches"),
        **scorer.data_options(),
        **sources,
    )


def build_method(cfg: DictConfig, loaded: LoadedModel, scorer: MCQAScorer) -> CalibrationMethod:
    """The method's LightningModule on the loaded LM, with the shared evaluation options and
    the run's MCQA scorer."""
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
        n_bins=cfg.evaluation.n_bins,
        openqa=cfg.evaluation.openqa,
        scoring=scorer,
        _convert_="all",
    )


def build_trainer(cfg: DictConfig, loggers: list, job_digest: str, with_retention: bool):
    """The run's Lightning trainer: its loggers, the configured callbacks with the job's own
    (stamped checkpoints, submitit's requeue), its world size checked; the job's device is set
    for the loaders that place weights themselves."""
    callbacks = [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node]
    callbacks += job_callbacks(job_digest)
    trainer = instantiate(
        cfg.trainer, logger=loggers or False, callbacks=callbacks, plugins=lightning_plugins()
    )
    check_world_size(trainer, with_retention)
    # FSDP shards the model it is handed on the CPU: its weights must not land whole on a GPU
    set_job_device(trainer.strategy.root_device, place_weights=not uses_fsdp(cfg.trainer))
    return trainer


def run_distortion(cfg: DictConfig, test_records: list) -> LogitDistortion | None:
    """The run's `model.logit_distortion` resolved on its MCQA test records with the model's
    tokenizer alone (None = off): a bad token set stops here, before the weights load."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if distortion_settings(model) is None:
        return None
    prompt = OmegaConf.select(cfg, "evaluation.cloze.prompt", default="chat")
    return resolve_distortion(model, load_tokenizer(model), test_records, prompt)


def distortion_record(distortion: LogitDistortion | None) -> dict:
    """metrics.json's `logit_distortion`, the ground truth of the run's distortion ({}: off)."""
    return {} if distortion is None else {"logit_distortion": distortion.record()}


def run_experiment(cfg: DictConfig) -> RunResult:
    """Run one (model, method, setting): validate, compose, build, calibrate, evaluate, write."""
    # validate: every value and requirement first, before anything is written, any data is
    # read, any logger is created or any weights load (validation.py)
    cls, sources = method_class(cfg), build_sources(cfg)
    validate_config(cfg, cls, sources)
    # claim: this job's folder (identity, lock, the checkpoint to resume, the attempt)
    with claimed_job(cfg) as (job, ckpt_path):
        return _run(cfg, cls, sources, job, ckpt_path)


def _run(cfg: DictConfig, cls, sources: dict, job, ckpt_path) -> RunResult:
    # compose: the resolved config and whatever a method_setting file changed, said up front
    out, main = job.path, is_main_process()
    method_setting = applied_method_setting(cfg)
    if main:
        write_config(out, cfg)
        log_method_setting(method_setting)
    scorer = scorer_from_config(cfg.evaluation)  # one per run: data module and method share it
    datamodule = build_datamodule(cfg, scorer, sources=sources)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    # build: the data (read and checked) and the retention tasks' data, then the trainer,
    # all before the model, whose loading takes minutes for a 7B model
    datamodule.load_records()
    distortion = run_distortion(cfg, datamodule.records["test"])
    retention = RetentionStep.from_config(cfg.evaluation.get("retention"), out)
    stopwatch, module, loggers = Stopwatch(), None, []
    try:
        loggers = build_loggers(cfg, resume_from=ckpt_path)
        trainer = build_trainer(cfg, loggers, job.digest, retention.enabled)
        with stopwatch.phase("load_model"):
            loaded = load_language_model(cfg.model, distortion)
        datamodule.tokenizer = loaded.tokenizer
        module = build_method(cfg, loaded, scorer)
        # the untouched model, scored on the same data by the same code before calibration
        # changes it (or read from the sweep's cache, where an earlier job scored it)
        rows, cached = base_rows(
            trainer, module, datamodule, retention, loaded.tokenizer, cfg, out, stopwatch
        )
        # calibrate
        with stopwatch.phase("calibrate"):
            fitted = module.calibrate(trainer, datamodule, ckpt_path)
        if module.changes_model and main:
            module.save_calibration(out / CALIBRATION_DIR)
        # evaluate
        with stopwatch.phase("evaluate"):
            evaluation = evaluate(trainer, module, datamodule, cfg, cfg.method.name, out)
        rows[cfg.method.name] = evaluation.metrics
        heldout = None
        if cfg.evaluation.get("heldout_metrics", True):
            with stopwatch.phase("evaluate_heldout"):
                heldout = heldout_metrics(trainer, module, datamodule, cfg.evaluation.n_bins)
        if retention.enabled and module.changes_model:
            with stopwatch.phase("retention"):
                retention.evaluate(cfg.method.name, module.model, loaded.tokenizer)
        # write
        extra = {"timings": stopwatch.seconds, **fitted, "method_setting": method_setting}
        extra |= {"attempts": job.attempts(), **distortion_record(distortion)}
        if cached:
            extra["base_cache"] = cached
        if heldout:
            extra["heldout"] = heldout
        summary = datamodule.summary(evaluation.summary.get("option_tokens"))
        result = RunResult(out, evaluation, rows, extra, data_summary=summary)
        if main:
            write_run(result)
            publish_results(loggers, cfg, result)
            n = evaluation.metrics["n"]
            print(f"\n{cfg.model.name} / {cfg.setting.name}  (n = {n} test questions, in {out})")
            print(format_table(rows))
            if retention.rows:
                write_retention(out, retention.record(run_meta(cfg)))
                print(f"\nretention (lm-eval, zero-shot; {out / RETENTION_FILE})")
                print(retention.table())
        return result
    finally:
        finish_loggers(loggers)
        del module
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
