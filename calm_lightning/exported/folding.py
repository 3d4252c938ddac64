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
"""

from __future__ import annotations

import torch
from torch import nn

from calm_lightning.models.logit_adjustment import LogitAdjustment

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
