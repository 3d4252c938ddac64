"""The final norm before the output layer, and multiplying every logit by one number there.

logits = E · norm(h) for the architectures below, with norm(h) = w ⊙ ĥ (RMSNorm) or
ĥ ⊙ (1 + w) (Gemma): scaling the norm's gain by k multiplies every logit by k exactly, with the
output layer untouched (it may be the input embedding, tied). `model.logit_scale` makes a model
over-confident this way, and the export folds a temperature (k = 1 / T) the same way, into a
tensor every server reads under the architecture's own name.
"""

from __future__ import annotations

import torch

# How the final norm applies its weight w to the normalised hidden state ĥ, by the config's
# model_type (read in transformers' modeling_<type>.py): "weight" = w ⊙ ĥ, "one_plus_weight"
# = ĥ ⊙ (1 + w). OLMo (1) is absent: its final LayerNorm has no weight at all.
NORM_FORMS = {
    "llama": "weight",
    "mistral": "weight",
    "qwen2": "weight",
    "qwen3": "weight",
    "olmo2": "weight",
    "phi3": "weight",
    "gemma": "one_plus_weight",
    "gemma2": "one_plus_weight",
    "gemma3": "one_plus_weight",
    "gemma3_text": "one_plus_weight",
}


def text_config(model: torch.nn.Module):
    """The language model's config (a multimodal model's text config)."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_types(model: torch.nn.Module) -> list[str]:
    """The model's `model_type` and its text config's, without repeats."""
    types = [str(getattr(model.config, "model_type", "")), str(text_config(model).model_type)]
    return list(dict.fromkeys(t for t in types if t))


def final_norm(model: torch.nn.Module) -> torch.nn.Module | None:
    """The norm applied to the last hidden state before the output layer, or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    norm = getattr(getattr(decoder, "language_model", decoder), "norm", None)
    return norm if isinstance(getattr(norm, "weight", None), torch.Tensor) else None


def norm_form(model: torch.nn.Module) -> str | None:
    """ "weight" or "one_plus_weight" for an architecture of NORM_FORMS, else None."""
    return next((NORM_FORMS[t] for t in model_types(model) if t in NORM_FORMS), None)


def guessed_norm_form(model: torch.nn.Module) -> str:
    """NORM_FORMS' entry, or for an architecture it lacks the class name's guess (Gemma's
    norms are the (1 + w) kind); `model.logit_scale` runs accept the guess, folds do not."""
    norm = final_norm(model)
    gemma = norm is not None and "gemma" in type(norm).__name__.lower()
    return norm_form(model) or ("one_plus_weight" if gemma else "weight")


@torch.no_grad()
def scale_final_norm(model: torch.nn.Module, factor: float, form: str) -> None:
    """Multiply every logit by `factor` through the final norm's weight (computed in fp32)."""
    norm = final_norm(model)
    if norm is None:
        raise ValueError(f"{type(model).__name__} has no final norm with a weight")
    weight = norm.weight
    if form == "one_plus_weight":
        weight.copy_(((1.0 + weight.float()) * factor - 1.0).to(weight.dtype))
    else:
        weight.copy_((weight.float() * factor).to(weight.dtype))
