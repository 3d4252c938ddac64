"""A scoring pass over the test split, and the untouched model's rows of a run.

`evaluate` scores the test split with a method's module as it is now (under DDP every process
scores its share; rank 0 writes the gathered predictions and the reliability diagram).
`evaluate_base` and `evaluate_base_retention` give the base row and the base retention row:
read from the sweep's cache where an earlier job with the same fingerprint measured them
(evaluation/base_cache.py), else measured here and stored; either way the run's folder holds the
same files and the method's row is scored as if the base had been measured here. `base_rows`
is the pipeline's step before calibration: whichever of the two the run asks for.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from calm_lightning.evaluation.base_cache import BaseCache, base_fingerprint, retention_fingerprint
from calm_lightning.evaluation.lm_eval_retention import preserved_rng
from calm_lightning.evaluation.mcqa import OptionTokens
from calm_lightning.evaluation.results import run_meta
from calm_lightning.metrics.bootstrap import BootstrapSettings
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.runtime.distributed import is_main_process
from calm_lightning.runtime.run_record import (
    BASE_DIR,
    RETENTION_DIR,
    Evaluation,
    read_predictions,
    reliability_path,
    write_predictions,
    write_row,
)


def evaluate(trainer, module, datamodule, cfg: DictConfig, name: str, out: Path) -> Evaluation:
    """Score the test split with the module as it is now (under DDP every process scores its
    share; rank 0 writes the gathered predictions and the reliability diagram under `out`)."""
    trainer.test(module, datamodule=datamodule, verbose=False)
    metrics = module.predictions.report(cfg.evaluation.n_bins)
    # ci95 and by_source: seconds of NumPy (metrics/bootstrap.py), the same on every process
    bootstrap = BootstrapSettings.from_config(cfg.evaluation.get("bootstrap"))
    sources = {r.id: r.source or None for r in datamodule.records.get("test", ())}
    metrics |= module.predictions.spread(cfg.evaluation.n_bins, bootstrap, sources)
    evaluation = module.predictions.evaluation(metrics, {**run_meta(cfg), "method": name})
    if is_main_process():
        write_predictions(out, evaluation)
        title = f"{cfg.model.name} / {name} / {cfg.setting.name}"
        module.predictions.plot_reliability(reliability_path(out), title=title)
    return evaluation


def evaluate_base(
    trainer, module, datamodule, cfg: DictConfig, out: Path, cache: BaseCache
) -> tuple[Evaluation, dict]:
    """The untouched model's row, and how it was had (metrics.json's `base_cache.base`): read
    from the cache when an earlier job with the same fingerprint scored it, else scored here
    (and stored). Either way the run's base/ folder holds the same files."""
    folder = out / BASE_DIR
    fingerprint = base_fingerprint(cfg, type(module), datamodule.records["test"], trainer)
    computed: list[Evaluation] = []

    def compute() -> dict:
        # The base pass must not move the random streams calibration draws from (the test
        # loader draws a seed): a run that reads its base row trains exactly as one that
        # scores it.
        with preserved_rng():
            evaluation = evaluate(trainer, module, datamodule, cfg, "base", folder)
        if is_main_process():
            write_row(folder, evaluation)
        computed.append(evaluation)
        return evaluation.summary

    summary, record = cache.fetch(fingerprint, compute, folder)
    if computed:
        return computed[0], record
    # This run's names (seed, setting) in place of the first job's, in the same key order.
    meta = {**run_meta(cfg), "method": "base"}
    summary = {key: meta.get(key, value) for key, value in summary.items()}
    evaluation = Evaluation(summary, read_predictions(cache.entry(record)))
    tokens = summary.get("option_tokens")
    if tokens is not None:  # the method's row is scored with the base row's option tokens
        module.option_tokens = OptionTokens(
            tokens["style"], tuple(tokens["ids"]), tokens["letters"]
        )
    if is_main_process():
        cache.restore(cache.entry(record), folder)
        write_row(folder, evaluation)
    return evaluation, record


def evaluate_base_retention(retention, module, tokenizer, cfg, out: Path, cache: BaseCache):
    """The untouched model's retention row, read from the cache or measured (and stored)."""
    folder = out / RETENTION_DIR / "base"
    fingerprint = retention_fingerprint(cfg, type(module), retention.settings)

    def compute() -> dict:
        return retention.evaluate("base", CalibratedLM(module.model.lm, None), tokenizer)

    row, record = cache.fetch(fingerprint, compute, folder)
    if record["status"] == "read":
        retention.rows["base"] = row
        if is_main_process():
            cache.restore(cache.entry(record), folder)
    return record


def base_rows(
    trainer, module, datamodule, retention, tokenizer, cfg: DictConfig, out: Path, stopwatch
) -> tuple[dict[str, dict], dict]:
    """Before calibration, while the adapters are zero and the head is the identity: the
    untouched model's row (when the method changes the model and `compare_with_base` is on)
    and its retention row (when retention runs), each scored here or read from the sweep's
    cache. Returns the compared rows so far and what the cache gave (metrics.json's
    `base_cache`)."""
    rows: dict[str, dict] = {}
    cache, cached = BaseCache.from_config(cfg), {}
    if module.changes_model and cfg.evaluation.get("compare_with_base", True):
        with stopwatch.phase("evaluate_base"):
            base, cached["base"] = evaluate_base(trainer, module, datamodule, cfg, out, cache)
        rows["base"] = base.metrics
    if retention.enabled:
        with stopwatch.phase("retention_base"):
            cached["retention_base"] = evaluate_base_retention(
                retention, module, tokenizer, cfg, out, cache
            )
    return rows, cached
