"""A finished run as the export and retention read it: the checks that it can be exported
(`inspect_run`, before anything heavy loads), the weights' dtype and its base model loaded
unquantized (`load_base_model`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from calm_lightning.errors import ConfigError, ExportError
from calm_lightning.models.calibrated_lm import ADAPTER_DIR, read_calibration_record
from calm_lightning.models.logit_adjustment import HEAD_FILE
from calm_lightning.runtime.run_record import (
    CALIBRATION_DIR,
    METRICS_FILE,
    RunRecord,
    RunRecordError,
    read_run,
)

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RunToExport:
    """What the checks found out about the run, before anything heavy is loaded."""

    record: RunRecord  # the run directory as read (run_record.py)
    method: str
    method_class: type
    base_dtype: str  # what the run loaded the base in (calibration/calibrated_lm.json)
    base_4bit: bool

    @property
    def run_dir(self) -> Path:
        return self.record.path

    @property
    def cfg(self):
        """The run's resolved config (DictConfig)."""
        return self.record.config

    @property
    def metrics(self) -> dict:
        """The run's metrics.json."""
        return self.record.summary

    @property
    def calibration_dir(self) -> Path:
        return self.record.calibration_dir

    @property
    def adapter_dir(self) -> Path | None:
        path = self.calibration_dir / ADAPTER_DIR
        return path if path.is_dir() else None

    @property
    def has_head(self) -> bool:
        return (self.calibration_dir / HEAD_FILE).is_file()

    @property
    def base_model_id(self) -> str | None:
        """The base model's Hub id where there is one (not for the in-code tiny model)."""
        model = self.cfg.model
        return model.get("model_id") if model.get("source") in ("hub", "embedded") else None


def inspect_run(run_dir: str | Path, exporting: bool = True) -> RunToExport:
    """Check that `run_dir` is a finished run of a method whose calibration can be exported.

    `exporting=False` (other readers of a saved run, e.g. retention) also accepts a run of a
    method that does not change the model: it has no calibration/ and uses the base as it is.
    """
    from omegaconf import OmegaConf

    try:
        saved = read_run(run_dir)
    except RunRecordError as err:
        raise ExportError(str(err)) from None
    run_dir, cfg = saved.path, saved.config
    method = str(OmegaConf.select(cfg, "method.name", default="?"))
    cls = _method_class(cfg, method)
    distortion = OmegaConf.select(cfg, "model.logit_distortion")
    if distortion is not None:
        # A forward hook, not in the weights: the saved model is not the one calibrated.
        raise ExportError(
            f"run_dir={run_dir} ran with model.logit_distortion={distortion}: its model adds "
            "a bias to some token logits through a hook that no saved weights carry, so an "
            "export (or a reload) would be a different model from the one calibrated. Export "
            "a run without model.logit_distortion."
        )
    if exporting and (not cls.changes_model or _computed_at_evaluation(cls)):
        raise ExportError(_nothing_to_export(cls, method, cfg))
    calibration = saved.calibration_dir
    if not calibration.is_dir() and cls.changes_model:
        raise ExportError(
            f"run_dir={run_dir} has no {CALIBRATION_DIR}/ folder, so there is no calibrated "
            f"model to export: a method={method} run writes it once calibration has finished. "
            "Was the run interrupted? Resume it with `python -m calm_lightning.run "
            f"ckpt_path={run_dir} ...` (same overrides) or run it again."
        )
    if not saved.finished:
        raise ExportError(
            f"run_dir={run_dir} has no {METRICS_FILE}: the run stopped before its final "
            "evaluation, whose option tokens and metrics the export records; run it again"
        )
    record = read_calibration_record(calibration)
    from calm_lightning.models.loading import resolve_dtype

    # Runs saved before the calibration recorded the base precision: the config's rule.
    dtype = record.get("base_dtype") or str(resolve_dtype(cfg.model.get("dtype", "auto")))
    quantization = cfg.model.get("quantization", "none")
    return RunToExport(
        record=saved,
        method=method,
        method_class=cls,
        base_dtype=dtype.removeprefix("torch."),
        base_4bit=bool(record.get("base_4bit", quantization == "nf4")),
    )


def _method_class(cfg, method: str) -> type:
    from calm_lightning.methods.base import method_class

    try:
        return method_class(cfg)
    except ConfigError as err:
        raise ExportError(
            f"unknown method {method!r}: not a method of this project, so the export cannot "
            f"tell what its run changed ({err})"
        ) from err


def _computed_at_evaluation(cls) -> bool:
    """Whether the method's confidence is computed at evaluation time (it overrides
    `option_probabilities`): the model's own probabilities are not the method's."""
    from calm_lightning.methods.base import CalibrationMethod

    return cls.option_probabilities is not CalibrationMethod.option_probabilities


def _nothing_to_export(cls, method: str, cfg) -> str:
    what = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
    if _computed_at_evaluation(cls):
        return (
            f"method={method} has nothing to export: it does not change the model's "
            f"probabilities; its confidence is computed at evaluation time ({what}). Only "
            "methods that change the model (calm, iterate, reg, ls, cft, ts, daca, "
            "dual_align) write a calibration to export."
        )
    return (
        f"method={method} has nothing to export: it evaluates the model as it is ({what}); "
        f"use the base model ({cfg.model.get('model_id') or cfg.model.get('name')}) itself."
    )


def target_dtype(run: RunToExport, requested: str = "auto") -> str:
    """The weights' dtype: the one the run computed in, or a 16-bit copy after 4-bit QLoRA."""
    if requested not in DTYPE_NAMES:
        raise ExportError(f"dtype={requested!r} is not one of {', '.join(DTYPE_NAMES)}")
    if requested != "auto":
        return requested
    if run.base_4bit:
        return run.base_dtype if run.base_dtype in ("bfloat16", "float16") else "bfloat16"
    return run.base_dtype


def load_base_model(run: RunToExport, dtype: str):
    """The run's base model, unquantized, at `dtype`, with its tokenizer."""
    from omegaconf import OmegaConf

    from calm_lightning.models.loading import DTYPES, load_language_model

    model_cfg = OmegaConf.to_container(run.cfg.model, resolve=True)
    model_cfg.update(dtype=dtype, quantization="none")
    loaded = load_language_model(model_cfg)
    if loaded.model.dtype != DTYPES[dtype]:  # the in-code tiny model is built in fp32
        loaded.model.to(DTYPES[dtype])
    loaded.model.eval()
    return loaded
