"""A finished run as the export and retention read it: the checks that it can be exported
(`inspect_run`, before anything heavy loads), the weights' dtype and its base model loaded
unquantized (`load_base_model`).

A run folder may come from someone else, so it is read as data, never as code
(`check_received_config`, docs/security.md): its config must hold resolved values only (a
`${...}` is refused, never resolved: it could read the environment), its method class must be
one of this project's (`calm_lightning.methods.<module>.<Class>`, checked before anything is
imported), its names plain (they become folder and file names), and the model's own code from
the Hub runs only when the command line says `trust_remote_code=true`, whatever the config says.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from calm_lightning.errors import ConfigError, ExportError, first_line
from calm_lightning.models.calibrated_lm import ADAPTER_DIR, read_calibration_record
from calm_lightning.models.logit_adjustment import HEAD_FILE
from calm_lightning.runtime.run_record import (
    CALIBRATION_DIR,
    CONFIG_FILE,
    METRICS_FILE,
    RunRecord,
    RunRecordError,
    read_run,
)

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
# A name that becomes part of a folder or file name, a model card or calibration.json.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.,=+-]{0,127}")
NAMED = ("model", "method", "setting")  # the config nodes whose `name` must be a SAFE_NAME
# The only classes a saved run may name: this project's methods.
METHOD_TARGET = re.compile(r"calm_lightning\.methods\.[a-z_][a-z0-9_]*\.[A-Za-z_][A-Za-z0-9_]*")


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
    except Exception as err:  # noqa: BLE001 (a record that does not parse: named, no traceback)
        raise ExportError(
            f"run_dir={run_dir}: a record does not parse ({first_line(err)})"
        ) from None
    check_received_config(saved.path, saved.config)
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


def check_received_config(run_dir: Path, cfg) -> None:
    """Refuse a saved config that is not plain data (see the module docstring); nothing in it
    is resolved or imported here."""
    from omegaconf import OmegaConf

    where = run_dir / CONFIG_FILE
    found = _interpolation(OmegaConf.to_container(cfg, resolve=False))
    if found is not None:
        raise ExportError(
            f"{where}: {found[0]}={found[1]!r} is an interpolation; a saved run's config holds "
            "resolved values only, and this one is not resolved (it could read environment "
            "variables). Remove it, or use the run folder as this project wrote it"
        )
    target = str(OmegaConf.select(cfg, "method.module._target_", default=None))
    if not METHOD_TARGET.fullmatch(target):
        raise ExportError(
            f"{where}: method.module._target_={target!r} is not one of this project's methods "
            "(calm_lightning.methods.<module>.<Class>); nothing was imported"
        )
    names = {f"{key}.name": OmegaConf.select(cfg, f"{key}.name") for key in NAMED}
    names["the run folder's name"] = Path(run_dir).resolve().name
    for key, value in names.items():
        if value is not None and not SAFE_NAME.fullmatch(str(value)):
            raise ExportError(
                f"{where}: {key}={value!r} is not a plain name (letters, digits and . _ - + , = "
                "only; it becomes part of file names); rename it"
            )


def _interpolation(node, prefix: str = "") -> tuple[str, str] | None:
    """The first (key, value) of a config tree whose value holds `${`."""
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return (prefix.rstrip("."), node) if isinstance(node, str) and "${" in node else None
    for key, value in items:
        found = _interpolation(value, f"{prefix}{key}.")
        if found is not None:
            return found
    return None


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


def load_base_model(run: RunToExport, dtype: str, trust_remote_code: bool = False):
    """The run's base model, unquantized, at `dtype`, with its tokenizer. The model's own code
    from the Hub runs only with `trust_remote_code` (the command line's), whatever the run's
    config says: a run that needs it is refused without."""
    from omegaconf import OmegaConf

    from calm_lightning.models.loading import DTYPES, load_language_model

    model_cfg = OmegaConf.to_container(run.cfg.model, resolve=True)
    if model_cfg.get("trust_remote_code") and not trust_remote_code:
        raise ExportError(
            f"{run.run_dir / CONFIG_FILE}: model.trust_remote_code=true: the base model "
            f"{model_cfg.get('model_id') or model_cfg.get('name')!r} needs code from its Hub "
            "repository, which runs only when asked: pass trust_remote_code=true if you trust it"
        )
    model_cfg.update(dtype=dtype, quantization="none", trust_remote_code=trust_remote_code)
    loaded = load_language_model(model_cfg)
    if loaded.model.dtype != DTYPES[dtype]:  # the in-code tiny model is built in fp32
        loaded.model.to(DTYPES[dtype])
    loaded.model.eval()
    return loaded
