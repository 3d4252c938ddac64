"""Writing a finished run's calibrated model as a Hugging Face model folder
(`python -m calm_lightning.export`, docs/export.md): weights (merged, or base + adapter/; the
head folded into the weights or shipped as custom code), tokenizer, the portable code,
calibration.json and the model card, staged in a hidden folder and renamed into place."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from calm_lightning.errors import ExportError
from calm_lightning.exported.calibration_info import calibration_info
from calm_lightning.exported.folding import (
    CUSTOM_CLASS,
    FOLD_NAMES,
    HEAD_MODULE,
    MODELING_MODULE,
    PROCESSOR_MODULE,
    adapts_output,
    place_head,
)
from calm_lightning.exported.private_paths import check_no_private_path, private_paths
from calm_lightning.exported.saved_run import (
    RunToExport,
    inspect_run,
    load_base_model,
    target_dtype,
)
from calm_lightning.models.calibrated_lm import ADAPTER_DIR
from calm_lightning.models.logit_adjustment import HEAD_FILE
from calm_lightning.models.logits_processor import CALIBRATION_FILE

log = logging.getLogger(__name__)


def export_run(
    run_dir: str | Path,
    out: str | Path,
    merge: bool = True,
    overwrite: bool = False,
    dtype: str = "auto",
    fold: str = "auto",
    trust_remote_code: bool = False,
) -> Path:
    """Write the run's calibrated model to `out` (see the module docstring); returns `out`.

    Everything is written to a hidden sibling folder first and renamed to `out` at the end,
    so a failed export leaves nothing behind (and an overwritten `out` stays intact until
    the new one is complete). `overwrite=True` replaces only an empty folder or an earlier
    export; `trust_remote_code` lets the base model's Hub code run (never the run's config).
    """
    out = Path(out)
    run = inspect_run(run_dir)
    if out.resolve() == run.run_dir.resolve() or out.resolve() in run.run_dir.resolve().parents:
        raise ExportError(f"out={out} would replace the run itself ({run.run_dir})")
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise ExportError(
                f"out={out} exists; pass overwrite=true to replace an earlier export, or "
                "another out="
            )
        check_replaceable(out)
    dtype = target_dtype(run, dtype)
    if fold not in FOLD_NAMES:
        raise ExportError(f"fold={fold!r} is not one of {', '.join(FOLD_NAMES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        write_folder(run, staging, merge, dtype, fold, trust_remote_code)
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


def check_replaceable(out: Path) -> None:
    """`overwrite=true` replaces only an empty folder or an earlier export (one holding
    calibration.json): a mistyped `out=` must not delete someone's folder."""
    if out.is_symlink() or not out.is_dir():
        raise ExportError(
            f"out={out} is not a folder; overwrite=true replaces only an empty folder or an "
            "earlier export: choose another out=, or move it away yourself"
        )
    if any(out.iterdir()) and not (out / CALIBRATION_FILE).is_file():
        raise ExportError(
            f"out={out} is not an earlier export (no {CALIBRATION_FILE}) and not empty; "
            "overwrite=true replaces only those: choose another out=, or move that folder away "
            "yourself (nothing was deleted)"
        )


def _publish(staging: Path, out: Path) -> None:
    """Rename the finished folder to `out`, replacing an existing one (an earlier export or
    an empty folder, checked again now) only now."""
    if out.exists() or out.is_symlink():
        check_replaceable(out)
        replaced = out.with_name(f".{out.name}.replaced-{uuid.uuid4().hex[:8]}")
        out.rename(replaced)
        staging.rename(out)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        staging.rename(out)


def write_folder(
    run: RunToExport,
    folder: Path,
    merge: bool,
    dtype: str,
    fold: str = "auto",
    trust_remote_code: bool = False,
) -> None:
    """Weights (merged, or base + adapter/; the head folded in or as custom code), tokenizer,
    calibration, model card."""
    loaded = load_base_model(run, dtype, trust_remote_code)
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
        serving = place_head(model, head, fold, adapted_output=adapts_output(adapter, merge))
    _save_model(
        model,
        folder,
        run.base_model_id or str(run.cfg.model.name),
        float(run.cfg.model.get("logit_scale", 1.0)),
    )
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
    check_no_private_path(folder, private_paths(run))


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
    from calm_lightning.exported import hub_modeling
    from calm_lightning.models import logit_adjustment, logits_processor

    (folder / HEAD_MODULE).write_text(portable_source(logit_adjustment))
    (folder / PROCESSOR_MODULE).write_text(portable_source(logits_processor))
    modeling = portable_source(hub_modeling) + (
        f"\n\nfrom transformers import {model_class.__name__}  # noqa: E402 (the base class)\n\n"
        f"{CUSTOM_CLASS} = calibrated_class({model_class.__name__})\n"
    )
    (folder / MODELING_MODULE).write_text(modeling)


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


def _save_model(model, folder: Path, public_name: str, logit_scale: float = 1.0) -> None:
    from calm_lightning.models.embedded import strip_gguf_quantizer
    from calm_lightning.models.loading import CARRIED_SCALE_KEY

    quantizer = getattr(model, "hf_quantizer", None)
    method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", None)
    if str(getattr(method, "value", method)).lower() == "gguf":
        # Weights loaded from a GGUF file are plain tensors, but the marker makes
        # save_pretrained refuse; the embedded model's conversion clears it the same way.
        strip_gguf_quantizer(model)
    model.config.use_cache = True  # runs switch it off for training; generation wants it
    # transformers before 5 writes `_name_or_path` (where the base was loaded from: a
    # model.local_path folder, the embedded model's cache) into config.json.
    model.config.name_or_path = public_name
    if logit_scale != 1.0:  # loading it with model.logit_scale again is refused (loading.py)
        setattr(model.config, CARRIED_SCALE_KEY, logit_scale)
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
