"""Folding a calibration head into the output layer, where that is exact.

The head computes z'_y = d_y (z_y - c) + l_y on the logits z = W h (+ b) of the output layer.
Softmax ignores a constant added to every token of a position, so the served distribution is
unchanged by dropping such constants:

* scalar head (one d, one l): z' = d z + const -> W <- d W (b <- d b); c and l drop out;
* vector head, l the same for every token, c = 0: row by row, W_y <- d_y W_y;
* vector head, l constant, c = mean(z): mean(z) = mean_y(W_y) h is linear in h too, so
  W_y <- d_y (W_y - mean W) (b likewise);
* vector head with per-token l (the paper's CALM), or c = logsumexp(z) with per-token d: no
  linear layer without a bias computes it. Those travel as custom code (hub_modeling.py).

A folded model is an ordinary checkpoint of the base architecture, so every server (vLLM, TGI,
llama.cpp after conversion, lm-eval, a plain pipeline) serves the calibrated distribution,
prompt log-probabilities included. Tied input/output embeddings are untied first (the input
embedding must stay as it was). Each fold is checked numerically on the model itself before it
is written.

`place_head` is the export's decision: fold where exact (and `fold=` allows), otherwise attach
the head for the custom code (hub_modeling.py) that the folder carries.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from calm_lightning.errors import ExportError
from calm_lightning.models.logit_adjustment import LogitAdjustment

log = logging.getLogger(__name__)

# The export's `fold=`: where exact | always (refused where not exact) | never.
FOLD_NAMES = ("auto", "true", "false")
# Files the export copies into the folder so it runs without this project: the head's module,
# the custom modeling code and the logits processor (their project imports made relative).
HEAD_MODULE = "logit_adjustment.py"
MODELING_MODULE = "modeling_calibrated.py"
PROCESSOR_MODULE = "calibration_processor.py"
CUSTOM_CLASS = "CalibratedForCausalLM"
PROBE_LENGTH = 16  # token ids of the numerical check of a fold

# Largest difference of next-token probabilities between the folded model and head(base
# logits) accepted, per weight dtype: fp32 folds are exact to rounding, 16-bit ones round W.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def fold_obstacle(head: LogitAdjustment, model: nn.Module, adapted_output: bool) -> str | None:
    """Why `head` cannot be folded into `model`'s output layer exactly, or None if it can."""
    if getattr(_text_config(model), "final_logit_softcapping", None):
        return "the model caps its logits after the output layer (final_logit_softcapping)"
    if adapted_output:
        return "the unmerged LoRA adapter changes the output layer itself"
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return "the output layer is not a linear layer"
    if head.kind == "scalar":
        return None
    bias = head.bias.detach()
    if not bool((bias == bias[0]).all()):
        return "the head adds a per-token bias l, which the output layer has no bias for"
    if head.center == "logsumexp":
        return "a per-token d on logsumexp-centred logits is not linear in the hidden state"
    return None


def untie_output_embeddings(model: nn.Module) -> bool:
    """Give the output layer its own copy of a weight shared with the input embedding."""
    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if output.weight.data_ptr() != embedding.weight.data_ptr():
        return False
    output.weight = nn.Parameter(output.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, _text_config(model))}.values():
        config.tie_word_embeddings = False
    return True


def _text_config(model: nn.Module):
    return (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )


@torch.no_grad()
def fold_head(model: nn.Module, head: LogitAdjustment, probe: torch.Tensor) -> float:
    """Fold `head` into `model`'s output layer in place (see the module docstring) and return
    the largest probability difference, on the `probe` token ids, between the folded model and
    head(the unfolded model's logits); raises ValueError when it exceeds the dtype's tolerance.
    """
    expected = torch.softmax(head(model(input_ids=probe).logits.float()), dim=-1)
    untie_output_embeddings(model)
    layer = model.get_output_embeddings()
    weight = layer.weight.float()
    layer_bias = None if layer.bias is None else layer.bias.float()
    d = head.scale.detach().float().to(weight.device)
    if head.kind == "vector" and head.center == "mean":
        weight = weight - weight.mean(0, keepdim=True)
        if layer_bias is not None:
            layer_bias = layer_bias - layer_bias.mean()
    scale = d[:, None] if head.kind == "vector" else d
    layer.weight.copy_((weight * scale).to(layer.weight.dtype))
    if layer_bias is not None:
        layer.bias.copy_((layer_bias * d).to(layer.bias.dtype))
    folded = torch.softmax(model(input_ids=probe).logits.float(), dim=-1)
    error = float((folded - expected).abs().max())
    tolerance = TOLERANCE.get(layer.weight.dtype, 1e-4)
    if error > tolerance:
        raise ValueError(
            f"folding the head changed next-token probabilities by {error:.2e} "
            f"(> {tolerance:g} for {layer.weight.dtype} weights)"
        )
    return error


def adapts_output(adapter: Path | None, merge: bool) -> bool:
    """Whether an adapter kept beside the weights (merge=false) changes the output layer."""
    if adapter is None or merge:
        return False
    targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules")
    names = targets if isinstance(targets, list) else [str(targets)]
    return any("lm_head" in str(name) or "embed_out" in str(name) for name in names)


def place_head(model, head, fold: str, adapted_output: bool) -> dict:
    """Fold the head into the output layer (where exact and allowed) or attach it for the
    custom code; returns calibration.json's `serving` block."""
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
