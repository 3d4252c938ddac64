"""calibration.json, the facts the export records and its model card reads: what the head
computes, how a server gets the calibrated distribution from the folder, for which method,
option tokens and prompt."""

from __future__ import annotations

from calm_lightning.evaluation.scorers import scorer_from_config
from calm_lightning.exported.folding import MODELING_MODULE, PROCESSOR_MODULE
from calm_lightning.exported.saved_run import RunToExport
from calm_lightning.models.calibrated_lm import ADAPTER_DIR
from calm_lightning.models.logit_adjustment import HEAD_FILE

FORMAT = "calm-lightning/calibration"

FORMAT_VERSION = 1

FORMULA = "z' = d * (z - c) + l"

CENTERS = {
    "none": "c = 0",
    "logsumexp": "c = logsumexp(z) over the vocabulary (per position)",
    "mean": "c = mean(z) over the vocabulary (per position)",
}


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
            # model.logit_scale: the run's final norm x k, in these weights too
            "logit_scale": float(run.cfg.model.get("logit_scale", 1.0)),
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
            "note": f"the head is folded into the {serving['folded_into'].replace('_', ' ')}'s "
            "weight: a server loading this checkpoint as the base architecture serves the "
            "calibrated distribution (docs/export.md lists which were checked); do not apply "
            "the head again",
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
