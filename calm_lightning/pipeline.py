"""The plain `run_experiment(cfg)` behind `python -m calm_lightning.run` (tests call it too):
compose -> seed -> build model, data, method -> fit (if the method trains) -> evaluate -> write."""

from __future__ import annotations

import gc
import json
import logging
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.openqa import OpenQAPredictions, write_openqa_results
from calm_lightning.evaluation.results import format_table, write_mcqa_results
from calm_lightning.methods.reference import check_reference_model
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.loading import LoadedModel, load_language_model
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import wrap_with_lora

log = logging.getLogger(__name__)

# Manual-optimization methods (CALM) checkpoint the state after their update on purpose: a
# checkpoint at outer step k holds the parameters and counter after step k, which is what a
# resume needs. Lightning warns that it cannot save a pre-update state; that is not wanted.
warnings.filterwarnings("ignore", message="Using ModelCheckpoint with manual optimization")


def build_calibrated_lm(cfg: DictConfig, loaded: LoadedModel) -> CalibratedLM:
    """Wrap the loaded LM with LoRA (per `peft`) and a head (per `method.head`)."""
    lm = loaded.model
    peft_cfg = OmegaConf.to_container(cfg.peft, resolve=True)
    method = peft_cfg.pop("method", "none")
    if not cfg.method.get("uses_adapter", True):
        method = "none"
    if method == "lora":
        lm = wrap_with_lora(lm, peft_cfg, quantized=loaded.quantized)
    elif method != "none":
        raise ValueError(f"peft.method={method!r} is not one of lora, none")
    head = None
    if cfg.method.get("head"):
        vocab = lm.get_output_embeddings().weight.shape[0]
        head = LogitAdjustment(vocab, **OmegaConf.to_container(cfg.method.head, resolve=True))
    return CalibratedLM(lm, head)


def build_sources(cfg: DictConfig) -> dict:
    """The setting's train / held-out / test sources (cheap: nothing is read yet)."""
    return {
        split: instantiate(cfg.setting[split]) if cfg.setting.get(split) is not None else None
        for split in ("train", "heldout", "test")
    }


def check_method_fits_setting(cfg: DictConfig, sources: dict) -> None:
    """Refuse a method / setting pair that cannot work, before any model is loaded."""
    requires = cfg.method.get("requires") or {}
    reason = requires.get("reason", "")
    kinds = requires.get("train_kind")
    kinds = [kinds] if isinstance(kinds, str) else list(kinds or [])
    if kinds and getattr(sources.get("train"), "kind", None) not in kinds:
        raise ConfigError(
            f"method={cfg.method.name} cannot run in setting={cfg.setting.name}: {reason}"
        )
    check_reference_model(cfg)
    if requires.get("heldout") and sources.get("heldout") is None:
        raise ConfigError(
            f"method={cfg.method.name} needs held-out data, which setting={cfg.setting.name} "
            "does not define"
        )


def build_datamodule(cfg: DictConfig, tokenizer, sources: dict | None = None):
    """The setting's data module (sources are instantiated from `setting.train/heldout/test`)."""
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
        **sources,
    )


def build_method(cfg: DictConfig, model: CalibratedLM, tokenizer):
    """The method's LightningModule, with the shared evaluation options."""
    return instantiate(
        cfg.method.module,
        model=model,
        tokenizer=tokenizer,
        option_tokens=cfg.evaluation.option_tokens,
        probe_size=cfg.evaluation.probe_size,
        n_bins=cfg.evaluation.n_bins,
        openqa=cfg.evaluation.openqa,
        _convert_="all",
    )


def resolve_checkpoint(cfg: DictConfig) -> str | None:
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


WANDB_ID_FILE = "wandb_id.txt"


def _wandb_overrides(cfg: DictConfig, node: DictConfig) -> dict:
    """Run id kept in the output dir (a resumed run continues the same W&B run) and, in a
    multirun, a group named after the sweep."""
    out = Path(cfg.paths.output_dir)
    extra: dict = {}
    if not node.get("id"):
        previous = resolve_checkpoint(cfg)
        candidates = [out / WANDB_ID_FILE]
        if previous:
            candidates.insert(0, Path(previous).parent.parent / WANDB_ID_FILE)
        found = next((c for c in candidates if c.is_file()), None)
        if found:
            run_id = found.read_text().strip()
        else:
            import secrets

            # W&B run ids are short lowercase alphanumerics; any unique such string works.
            run_id = secrets.token_hex(4)
        (out / WANDB_ID_FILE).write_text(run_id)
        extra["id"] = run_id
    if not node.get("group"):
        from calm_lightning.config import in_multirun

        if in_multirun():
            from hydra.core.hydra_config import HydraConfig

            extra["group"] = Path(HydraConfig.get().sweep.dir).name
        else:
            extra["group"] = cfg.setting.name
    return extra


def build_loggers(cfg: DictConfig) -> list:
    loggers = []
    for node in (cfg.get("logger") or {}).values():
        if not node:
            continue
        is_wandb = str(node.get("_target_", "")).endswith("WandbLogger")
        loggers.append(instantiate(node, **(_wandb_overrides(cfg, node) if is_wandb else {})))
    return loggers


def publish_to_wandb(loggers: list, cfg: DictConfig, out: Path, rows: dict) -> None:
    """Final metrics into the run summary, the resolved config (flattened), the reliability
    diagram as an image and the per-example predictions as a table."""
    for logger in loggers:
        if type(logger).__name__ != "WandbLogger":
            continue
        import pandas as pd
        import wandb

        flat = pd.json_normalize(OmegaConf.to_container(cfg, resolve=True), sep=".")
        logger.log_hyperparams(flat.iloc[0].to_dict())
        run = logger.experiment
        for method, metrics in rows.items():
            run.summary.update({f"{method}/{k}": v for k, v in metrics.items()})
        run.log({"reliability": wandb.Image(str(out / "reliability.png"))})
        rows_json = [
            json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()
        ]
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


def build_callbacks(cfg: DictConfig) -> list:
    return [instantiate(node) for node in (cfg.get("callbacks") or {}).values() if node]


def evaluate(trainer, module, datamodule, out: Path, cfg: DictConfig, method_name: str) -> dict:
    """Score the test split with the module as it is now and write its result files."""
    trainer.test(module, datamodule=datamodule, verbose=False)
    metrics = module.predictions.report(cfg.evaluation.n_bins)
    meta = {
        "model": cfg.model.name,
        "model_id": cfg.model.get("model_id"),
        "method": method_name,
        "setting": cfg.setting.name,
        "seed": cfg.seed,
    }
    title = f"{cfg.model.name} / {method_name} / {cfg.setting.name}"
    if isinstance(module.predictions, OpenQAPredictions):
        write_openqa_results(out, module.predictions, metrics, meta, title=title)
    else:
        write_mcqa_results(out, module.predictions, metrics, meta, title=title)
    return metrics


def run_experiment(cfg: DictConfig) -> dict:
    """Run one (model, method, setting) and return its test metrics."""
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, out / "config_resolved.yaml", resolve=True)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    timings: dict[str, float] = {}
    loggers: list = []
    module = None
    sources = build_sources(cfg)
    check_method_fits_setting(cfg, sources)
    try:
        start = time.perf_counter()
        loaded = load_language_model(cfg.model)
        timings["load_model_s"] = time.perf_counter() - start
        model = build_calibrated_lm(cfg, loaded)
        datamodule = build_datamodule(cfg, loaded.tokenizer, sources)
        module = build_method(cfg, model, loaded.tokenizer)
        loggers = build_loggers(cfg)
        callbacks = build_callbacks(cfg) if module.trains else []
        trainer = instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks)
        rows: dict[str, dict] = {}
        extras: dict = {}
        posthoc = getattr(module, "posthoc", False)
        if (module.trains or posthoc) and cfg.evaluation.get("compare_with_base", True):
            # Before fit the adapters are zero and the head is the identity: this is exactly
            # the untouched model, scored on the same data by the same code.
            start = time.perf_counter()
            rows["base"] = evaluate(trainer, module, datamodule, out / "base", cfg, "base")
            timings["evaluate_base_s"] = time.perf_counter() - start
        if module.trains:
            start = time.perf_counter()
            trainer.fit(module, datamodule=datamodule, ckpt_path=resolve_checkpoint(cfg))
            timings["fit_s"] = time.perf_counter() - start
            module.save_calibration(out / "calibration")
        if posthoc:
            start = time.perf_counter()
            trainer.predict(
                module, dataloaders=module.posthoc_loader(datamodule), return_predictions=False
            )
            extras["posthoc"] = module.fit_posthoc()
            timings["fit_posthoc_s"] = time.perf_counter() - start
            module.save_calibration(out / "calibration")
        start = time.perf_counter()
        metrics = evaluate(trainer, module, datamodule, out, cfg, cfg.method.name)
        timings["evaluate_s"] = time.perf_counter() - start
        rows[cfg.method.name] = metrics
        _annotate_metrics(out, rows, timings, extras)
        publish_to_wandb(loggers, cfg, out, rows)
        datamodule.write_summary(out)
        title = f"{cfg.model.name} / {cfg.setting.name}"
        print(f"\n{title}  (n = {metrics['n']} test questions, outputs in {out})")
        print(format_table(rows))
        return metrics
    finally:
        _finish(loggers)
        del module
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _annotate_metrics(out: Path, rows: dict, timings: dict, extras: dict) -> None:
    """Add the comparison rows, wall times and method extras (e.g. T) to metrics.json."""
    path = out / "metrics.json"
    payload = json.loads(path.read_text())
    payload["comparison"] = rows
    payload["timings"] = timings
    payload.update(extras)
    path.write_text(json.dumps(payload, indent=2))


def _finish(loggers: list) -> None:
    """Close loggers so the next job of a multirun starts clean (W&B needs an explicit finish)."""
    for logger in loggers:
        experiment = getattr(logger, "_experiment", None)
        if experiment is not None and hasattr(experiment, "finish"):
            experiment.finish()
