"""Folding a calibration head into the weights, where that is exact and servers read it.

The head computes z'_y = d_y (z_y - c) + l_y on the logits z = W h of the output layer, h the
final norm's output. Softmax ignores a constant added to every token of a position, so the
served distribution is unchanged by dropping such constants:

* scalar head (one d, one l; a temperature is d = 1 / T): z' = d z + const. The fold scales the
  final norm's gain by d (models/final_norm.py; Gemma's (1 + w) form included), so logits are
  d W h with W untouched: tied input/output embeddings stay tied, and every server that reads
  the architecture's final norm (all of them: it is an ordinary weight) serves z'. Refused where
  the model caps its logits after the output layer (tanh soft-capping is not linear) and for an
  architecture missing from final_norm.NORM_FORMS;
* vector head, l the same for every token, c = 0 or c = mean(z): row by row, W_y <- d_y W_y or
  W_y <- d_y (W_y - mean W). Only into an output layer of its own (`tie_word_embeddings`
  false) of an architecture whose servers read `lm_head.weight` (OUTPUT_LAYER_SERVED): untying
  a tied model would write a checkpoint that vLLM's Gemma 3 cannot load and that llama.cpp's
  Gemma converter turns into an uncalibrated GGUF (docs/export.md);
* vector head with per-token l (the paper's CALM), or c = logsumexp(z) with per-token d: no
  weight of the base architecture computes it. Those travel as custom code (hub_modeling.py).

Each fold is checked numerically on the model itself before it is written. `place_head` is the
export's decision: fold where exact (and `fold=` allows), otherwise attach the head for the
custom code that the folder carries, with the reason recorded.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from calm_lightning.errors import ExportError
from calm_lightning.models.final_norm import model_types, norm_form, scale_final_norm, text_config
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
# Where a fold goes (calibration.json: serving.folded_into).
FINAL_NORM, OUTPUT_LAYER = "final_norm", "output_layer"
# Architectures whose untied `lm_head.weight` vLLM, TGI and llama.cpp's converter read as the
# output layer (docs/export.md, the server table). Gemma's servers always use the embedding.
OUTPUT_LAYER_SERVED = ("llama", "mistral", "qwen2", "qwen3", "olmo2")

# Largest difference of next-token probabilities between the folded model and head(base
# logits) accepted, per weight dtype: fp32 folds are exact to rounding, 16-bit ones round W.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def fold_target(head: LogitAdjustment, model: nn.Module, adapted_output: bool) -> tuple:
    """(where the head folds, None) or (None, why it cannot be folded exactly)."""
    if getattr(text_config(model), "final_logit_softcapping", None):
        return None, "the model caps its logits after the output layer (final_logit_softcapping)"
    if head.kind == "scalar":
        if norm_form(model) is None:
            return None, (
                f"no final-norm rule for model_type {'/'.join(model_types(model))} "
                "(calm_lightning/models/final_norm.py: NORM_FORMS)"
            )
        output = model.get_output_embeddings()
        if getattr(output, "bias", None) is not None:
            return None, "the output layer has a bias, which the final norm does not scale"
        return FINAL_NORM, None
    bias = head.bias.detach()
    if not bool((bias == bias[0]).all()):
        return None, "the head adds a per-token bias l, which the output layer has no bias for"
    if head.center == "logsumexp":
        return None, "a per-token d on logsumexp-centred logits is not linear in the hidden state"
    return _output_layer_target(model, adapted_output)


def _output_layer_target(model: nn.Module, adapted_output: bool) -> tuple:
    """Whether a per-token d can go into the output layer servers read."""
    if adapted_output:
        return None, "the unmerged LoRA adapter changes the output layer itself"
    if not isinstance(model.get_output_embeddings(), nn.Linear):
        return None, "the output layer is not a linear layer"
    if getattr(text_config(model), "tie_word_embeddings", False):
        return None, (
            "a per-token scale needs an output layer of its own, and this model's is the input "
            "embedding (tie_word_embeddings): untied, servers would read the embedding instead"
        )
    if not set(model_types(model)) & set(OUTPUT_LAYER_SERVED):
        return None, (
            f"servers of model_type {'/'.join(model_types(model))} are not known to read "
            "lm_head.weight as the output layer"
        )
    return OUTPUT_LAYER, None


def fold_obstacle(head: LogitAdjustment, model: nn.Module, adapted_output: bool) -> str | None:
    """Why `head` cannot be folded into `model`'s weights exactly, or None if it can."""
    return fold_target(head, model, adapted_output)[1]


@torch.no_grad()
def fold_head(model: nn.Module, head: LogitAdjustment, probe: torch.Tensor) -> float:
    """Fold `head` into `model`'s weights in place (see the module docstring) and return the
    largest probability difference, on the `probe` token ids, between the folded model and
    head(the unfolded model's logits); raises ValueError when it exceeds the dtype's tolerance.
    """
    target, obstacle = fold_target(head, model, adapted_output=False)
    if target is None:
        raise ValueError(f"the head cannot be folded: {obstacle}")
    expected = torch.softmax(head(model(input_ids=probe).logits.float()), dim=-1)
    if target == FINAL_NORM:
        scale_final_norm(model, float(head.scale.detach().float().reshape(-1)[0]), norm_form(model))
        changed = model.get_decoder()
    else:
        changed = _fold_into_output_layer(model.get_output_embeddings(), head)
    folded = torch.softmax(model(input_ids=probe).logits.float(), dim=-1)
    error = float((folded - expected).abs().max())
    dtype = next(changed.parameters()).dtype
    tolerance = TOLERANCE.get(dtype, 1e-4)
    if error > tolerance:
        raise ValueError(
            f"folding the head changed next-token probabilities by {error:.2e} "
            f"(> {tolerance:g} for {dtype} weights)"
        )
    return error


def _fold_into_output_layer(layer: nn.Linear, head: LogitAdjustment) -> nn.Linear:
    """W_y <- d_y W_y (c = 0) or d_y (W_y - mean W) (c = mean), the bias likewise."""
    weight = layer.weight.float()
    layer_bias = None if layer.bias is None else layer.bias.float()
    d = head.scale.detach().float().to(weight.device)
    if head.center == "mean":
        weight = weight - weight.mean(0, keepdim=True)
        if layer_bias is not None:
            layer_bias = layer_bias - layer_bias.mean()
    layer.weight.copy_((weight * d[:, None]).to(layer.weight.dtype))
    if layer_bias is not None:
        layer.bias.copy_((layer_bias * d).to(layer.bias.dtype))
    return layer


def adapts_output(adapter: Path | None, merge: bool) -> bool:
    """Whether an adapter kept beside the weights (merge=false) changes the output layer."""
    if adapter is None or merge:
        return False
    targets = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules")
    names = targets if isinstance(targets, list) else [str(targets)]
    return any("lm_head" in str(name) or "embed_out" in str(name) for name in names)


def place_head(model, head, fold: str, adapted_output: bool) -> dict:
    """Fold the head into the weights (where exact and allowed) or attach it for the custom
    code; returns calibration.json's `serving` block."""
    from calm_lightning.exported.hub_modeling import CONFIG_KEY, HEAD_ATTRIBUTE

    target, obstacle = fold_target(head, model, adapted_output)
    if fold == "true" and obstacle is not None:
        raise ExportError(
            f"fold=true: this head cannot be folded into the weights exactly ({obstacle}); "
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
        log.info("folded the %s head into the %s (max probability change %.1e)",
                 head.kind, target.replace("_", " "), error)  # fmt: skip
        return {"calibration": "folded", "folded_into": target, "max_probability_error": error}
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
