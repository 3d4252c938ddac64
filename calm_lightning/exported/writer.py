"""`python -m calm_lightning.export run_dir=<run dir> out=<dir> [merge=true] [fold=auto]
[overwrite=false] [dtype=auto]`: a finished run's calibrated model as a standard Hugging Face
model folder.

The calibration travels with the weights. Where it is exact (a scalar head, as post-hoc
temperature scaling, DACA and Dual-Align learn; a vector head without a per-token bias), the
head is folded into the output layer (`fold=auto`, the default): the folder is an ordinary
checkpoint that every server reproduces. Other heads (the paper's CALM) travel as transformers
custom code: `AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)` applies the
head in `forward`; without `trust_remote_code` the folder loads as the uncalibrated model, and
`CalibrationLogitsProcessor` (also in the folder) applies the head in `generate`. A
calibration.json says what was done; docs/export.md describes the folder.

The arguments are a handful of scalars, parsed here as key=value (the same look as a run's
command line) rather than through Hydra: there is nothing to compose, and a Hydra app would
add an output directory, its own logging and a .hydra/ folder the export has no use for.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass, fields
from pathlib import Path

from calm_lightning.errors import ConfigError, ExportError, run_command
from calm_lightning.evaluation.scorers import scorer_from_config
from calm_lightning.exported.logits_processor import CALIBRATION_FILE
from calm_lightning.models.calibrated_lm import ADAPTER_DIR, read_calibration_record
from calm_lightning.models.logit_adjustment import HEAD_FILE
from calm_lightning.runtime.run_record import (
    CALIBRATION_DIR,
    METRICS_FILE,
    RunRecord,
    RunRecordError,
    read_run,
)

log = logging.getLogger(__name__)

USAGE = (
    "usage: python -m calm_lightning.export run_dir=<run dir> out=<folder> "
    "[merge=true|false] [fold=auto|true|false] [overwrite=false|true] "
    "[dtype=auto|float32|bfloat16|float16]"
)
DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
FOLD_NAMES = ("auto", "true", "false")
# Files the export copies into the folder so it runs without this project: the head's module,
# the custom modeling code and the logits processor (their project imports made relative).
HEAD_MODULE = "logit_adjustment.py"
MODELING_MODULE = "modeling_calibrated.py"
PROCESSOR_MODULE = "calibration_processor.py"
CUSTOM_CLASS = "CalibratedForCausalLM"
PROBE_LENGTH = 16  # token ids of the numerical check of a fold
FORMAT = "calm-lightning/calibration"
FORMAT_VERSION = 1
FORMULA = "z' = d * (z - c) + l"
CENTERS = {
    "none": "c = 0",
    "logsumexp": "c = logsumexp(z) over the vocabulary (per position)",
    "mean": "c = mean(z) over the vocabulary (per position)",
}


@dataclass(frozen=True)
class ExportOptions:
    """The command line: which run, where to, and how."""

    run_dir: Path
    out: Path
    merge: bool = True  # merge LoRA adapters into the weights; false: base + PEFT adapter folder
    fold: str = "auto"  # fold the head into the output layer: auto = where exact; false = never
    overwrite: bool = False  # replace an existing `out`
    dtype: str = "auto"  # weights' dtype; auto = the run's (a 16-bit copy after 4-bit QLoRA)


def parse_arguments(argv: list[str]) -> ExportOptions:
    """key=value arguments into `ExportOptions`; anything else stops with the usage line."""
    known = {f.name for f in fields(ExportOptions)}
    values: dict[str, str] = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or key not in known:
            raise ExportError(
                f"unknown argument {arg!r} (arguments are key=value, keys: "
                f"{', '.join(sorted(known))})\n{USAGE}"
            )
        values[key] = value
    missing = [k for k in ("run_dir", "out") if not values.get(k)]
    if missing:
        raise ExportError(f"missing {' and '.join(f'{k}=' for k in missing)}\n{USAGE}")
    options = {"run_dir": Path(values["run_dir"]), "out": Path(values["out"])}
    for key in ("merge", "overwrite"):
        if key in values:
            options[key] = _boolean(key, values[key])
    if "dtype" in values:
        options["dtype"] = values["dtype"]
    if "fold" in values:
        if values["fold"].lower() not in FOLD_NAMES:
            raise ExportError(f"fold={values['fold']!r} is not one of {', '.join(FOLD_NAMES)}")
        options["fold"] = values["fold"].lower()
    return ExportOptions(**options)


def _boolean(key: str, value: str) -> bool:
    lowered = value.lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ExportError(f"{key}={value!r} is not true or false")


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
    if not cls.changes_model and exporting:
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


def _nothing_to_export(cls, method: str, cfg) -> str:
    from calm_lightning.methods.base import CalibrationMethod

    what = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
    if cls.option_probabilities is not CalibrationMethod.option_probabilities:
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


def export_run(
    run_dir: str | Path,
    out: str | Path,
    merge: bool = True,
    overwrite: bool = False,
    dtype: str = "auto",
    fold: str = "auto",
) -> Path:
    """Write the run's calibrated model to `out` (see the module docstring); returns `out`.

    Everything is written to a hidden sibling folder first and renamed to `out` at the end,
    so a failed export leaves nothing behind (and an overwritten `out` stays intact until
    the new one is complete).
    """
    out = Path(out)
    run = inspect_run(run_dir)
    if out.exists() and not overwrite:
        raise ExportError(f"out={out} exists; pass overwrite=true to replace it, or another out=")
    if out.resolve() == run.run_dir.resolve() or out.resolve() in run.run_dir.resolve().parents:
        raise ExportError(f"out={out} would replace the run itself ({run.run_dir})")
    dtype = target_dtype(run, dtype)
    if fold not in FOLD_NAMES:
        raise ExportError(f"fold={fold!r} is not one of {', '.join(FOLD_NAMES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write_folder(run, staging, merge=merge, dtype=dtype, fold=fold)
        _usual_permissions(staging)
        _publish(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    log.info("exported %s (method=%s) to %s", run.run_dir, run.method, out)
    return out


def _usual_permissions(folder: Path) -> None:
    """The modes a plain mkdir / open would give (mkdtemp makes the folder private, and
    some writers their files): the export is meant to be shared."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished folder to `out`, replacing an existing one only now."""
    if out.exists():
        replaced = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
        out.rename(replaced)
        staging.rename(out)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        staging.rename(out)


def write_folder(
    run: RunToExport, folder: Path, merge: bool, dtype: str, fold: str = "auto"
) -> None:
    """Weights (merged, or base + adapter/; the head folded in or as custom code), tokenizer,
    calibration, model card."""
    loaded = load_base_model(run, dtype)
    model, tokenizer = loaded.model, loaded.tokenizer
    head = _check_head(run, model)
    adapter = run.adapter_dir
    if adapter is not None and run.base_4bit:
        log.warning(
            "The run trained 4-bit QLoRA adapters; they are applied to a %s copy of the base "
            "model (the exported numbers differ slightly from the run's 4-bit ones).",
            dtype,
        )
    if adapter is not None and merge:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    serving = None
    if head is not None:
        serving = _place_head(model, head, fold, adapted_output=_adapts_output(adapter, merge))
    _save_model(model, folder)
    if adapter is not None and not merge:
        _copy_adapter(adapter, folder / ADAPTER_DIR, run.base_model_id)
    tokenizer.save_pretrained(folder)
    if serving is not None and serving["calibration"] == "custom_code":
        shutil.copyfile(run.calibration_dir / HEAD_FILE, folder / HEAD_FILE)
        _write_portable_code(folder, type(model))
    info = calibration_info(
        run, tokenizer, head, merged=adapter is not None and merge, dtype=dtype, serving=serving
    )
    (folder / CALIBRATION_FILE).write_text(json.dumps(info, indent=2) + "\n")
    from calm_lightning.exported.model_card import write_model_card

    write_model_card(run, folder, info)


def _adapts_output(adapter: Path | None, merge: bool) -> bool:
    """Whether an adapter kept beside the weights (merge=false) changes the output layer."""
    if adapter is None or merge:
        return False
    targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules")
    names = targets if isinstance(targets, list) else [str(targets)]
    return any("lm_head" in str(name) or "embed_out" in str(name) for name in names)


def _place_head(model, head, fold: str, adapted_output: bool) -> dict:
    """Fold the head into the output layer (where exact and allowed) or attach it for the
    custom code; returns calibration.json's `serving` block."""
    import torch

    from calm_lightning.exported.folding import fold_head, fold_obstacle
    from calm_lightning.exported.hub_modeling import CONFIG_KEY, HEAD_ATTRIBUTE

    obstacle = fold_obstacle(head, model, adapted_output)
    if fold == "true" and obstacle is not None:
        raise ExportError(
            f"fold=true: this head cannot be folded into the output layer exactly ({obstacle}); "
            "use fold=auto, which ships it as custom code instead"
        )
    if fold != "false" and obstacle is None:
        generator = torch.Generator().manual_seed(0)
        vocab = model.get_output_embeddings().weight.shape[0]
        probe = torch.randint(vocab, (2, PROBE_LENGTH), generator=generator)
        try:
            error = fold_head(model, head.to(model.device), probe.to(model.device))
        except ValueError as err:
            raise ExportError(f"{err}; export with fold=false to keep the head separate") from err
        log.info("folded the %s head into the output layer (max probability change %.1e)",
                 head.kind, error)  # fmt: skip
        return {"calibration": "folded", "max_probability_error": error}
    if not _transformers_class(type(model)):
        raise ExportError(
            f"the head must travel as custom code (it cannot be folded: {obstacle}), but the "
            f"model class {type(model).__name__} is not importable from transformers"
        )
    setattr(model, HEAD_ATTRIBUTE, head.to(model.device).requires_grad_(False))
    setattr(model.config, CONFIG_KEY, {
        "vocab_size": head.vocab_size, "kind": head.kind, "center": head.center,
    })  # fmt: skip
    model.config.auto_map = {"AutoModelForCausalLM": f"{MODELING_MODULE[:-3]}.{CUSTOM_CLASS}"}
    return {"calibration": "custom_code", "why_not_folded": obstacle or "fold=false"}


def _transformers_class(cls: type) -> bool:
    import transformers

    return getattr(transformers, cls.__name__, None) is cls


def portable_source(module) -> str:
    """`module`'s source with its import of the head's module made relative (a sibling file
    in the export folder); refuses any other import of this project."""
    import inspect

    from calm_lightning.models import logit_adjustment

    source = inspect.getsource(module)
    if module is not logit_adjustment:
        source = source.replace(
            f"from {logit_adjustment.__name__} import", f"from .{HEAD_MODULE[:-3]} import"
        )
    leftover = [
        line for line in source.splitlines()
        if line.lstrip().startswith(("import calm_lightning", "from calm_lightning"))
    ]  # fmt: skip
    if leftover:
        raise ExportError(f"{module.__name__} is not self-contained: {leftover}")
    return source


def _write_portable_code(folder: Path, model_class: type) -> None:
    """The head's module, the custom modeling code on `model_class` and the processor."""
    from calm_lightning.exported import hub_modeling, logits_processor
    from calm_lightning.models import logit_adjustment

    (folder / HEAD_MODULE).write_text(portable_source(logit_adjustment))
    (folder / PROCESSOR_MODULE).write_text(portable_source(logits_processor))
    modeling = portable_source(hub_modeling) + (
        f"\n\nfrom transformers import {model_class.__name__}  # noqa: E402 (the base class)\n\n"
        f"{CUSTOM_CLASS} = calibrated_class({model_class.__name__})\n"
    )
    (folder / MODELING_MODULE).write_text(modeling)


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


def _check_head(run: RunToExport, model):
    """The run's head, after checking it fits the model's output layer."""
    if not run.has_head:
        return None
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    head = LogitAdjustment.load(run.calibration_dir)
    vocab = model.get_output_embeddings().weight.shape[0]
    if head.vocab_size != vocab:
        raise ExportError(
            f"the run's head has {head.vocab_size} entries but the base model's output layer "
            f"has {vocab}: {run.calibration_dir} does not belong to this base model"
        )
    return head


def _save_model(model, folder: Path) -> None:
    from calm_lightning.models.embedded import strip_gguf_quantizer

    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if str(getattr(method, "value", method)).lower() == "gguf":
        # Weights loaded from a GGUF file are plain tensors, but the marker makes
        # save_pretrained refuse; the embedded model's conversion clears it the same way.
        strip_gguf_quantizer(model)
    model.config.use_cache = True  # runs switch it off for training; generation wants it
    model.save_pretrained(folder)


def _copy_adapter(source: Path, target: Path, base_model_id: str | None) -> None:
    """The run's PEFT adapter, pointing at the base model's Hub id (not a local cache path)."""
    target.mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(source / name, target / name)
    config_file = target / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = base_model_id
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def calibration_info(
    run: RunToExport, tokenizer, head, merged: bool, dtype: str, serving: dict | None = None
) -> dict:
    """calibration.json: what the head computes, how it is served, for which method, tokens
    and prompt."""
    head_info = None
    if head is not None:
        head_info = {
            "file": HEAD_FILE,
            "kind": head.kind,
            "center": head.center,
            "vocab_size": head.vocab_size,
            "tensors": {"d": "scale", "l": "bias"},
        }
        if run.method_class.head == "temperature":
            head_info["temperature"] = 1.0 / float(head.scale.item())
    folded = serving is not None and serving["calibration"] == "folded"
    if folded:
        head_info["file"] = None  # in the output layer's weights now
    formula = {
        "formula": FORMULA if head is not None else "z' = z (no head: the weights carry it)",
        "terms": {
            "z": "the model's next-token logits (one position, full vocabulary)",
            "d": "per-token scale (vector head) or one number (scalar head); a post-hoc "
            "temperature T is the scalar head d = 1 / T, l = 0, c = 0",
            "l": "per-token bias (vector head) or one number (scalar head)",
            "c": CENTERS[head.center] if head is not None else None,
        },
        "probabilities": "softmax(z') over the vocabulary when generating; for multiple-choice "
        "scoring see `prompt` (the option letters' token ids at the answer slot, or each "
        "option text's likelihood)",
    }
    option_tokens = run.metrics.get("option_tokens")
    from calm_lightning import __version__

    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "serving": _serving_info(serving, head),
        "calm_lightning_version": __version__,
        "method": {
            "name": run.method,
            "class": str(run.cfg.method.module._target_),
            "fitted": run.metrics.get("posthoc"),
        },
        "head": head_info,
        **formula,
        "weights": {
            "adapter": None if run.adapter_dir is None else ("merged" if merged else ADAPTER_DIR),
            "dtype": dtype,
            "trained_on_4bit_base": run.base_4bit,
        },
        "base_model": run.base_model_id,
        "option_tokens": option_tokens,
        "prompt": scorer_from_config(run.cfg.get("evaluation")).prompt_format(
            tokenizer, int(run.cfg.setting.get("eval_max_length") or 1024)
        ),
        "run": {
            "model": run.cfg.model.name,
            "setting": run.cfg.setting.name,
            "seed": run.cfg.get("seed"),
            "run_name": run.run_dir.resolve().name,  # no local path leaves the machine
        },
    }


def _serving_info(serving: dict | None, head) -> dict:
    """How a server gets the calibrated distribution from this folder."""
    if head is None:
        return {"calibration": "weights", "trust_remote_code": False,
                "note": "no head: the calibration is in the weights"}  # fmt: skip
    if serving["calibration"] == "folded":
        return {
            **serving,
            "trust_remote_code": False,
            "note": "the head is folded into the output layer: any server loading this "
            "checkpoint serves the calibrated distribution; do not apply the head again",
        }
    return {
        **serving,
        "trust_remote_code": True,
        "modeling_file": MODELING_MODULE,
        "processor_file": PROCESSOR_MODULE,
        "note": "load with trust_remote_code=True (forward applies the head), or load plainly "
        "and apply calibration_processor.CalibrationLogitsProcessor in generate; never both. "
        "Loaded plainly without the processor, this is the uncalibrated model.",
    }


def main(argv: list[str] | None = None) -> int:
    """The command line; errors the user can fix print their message without a traceback."""

    def action(args: list[str]) -> str:
        options = parse_arguments(args)
        out = export_run(**{f.name: getattr(options, f.name) for f in fields(ExportOptions)})
        return f"exported to {out} (see {out / 'README.md'})"

    return run_command(argv, __doc__.split("\n\n")[0], USAGE, action)


if __name__ == "__main__":
    raise SystemExit(main())
