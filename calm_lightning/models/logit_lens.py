"""Logit lens: every decoder layer's residual stream at the last prompt token, read out through
the model's final norm and unembedding and restricted to the option tokens, in one forward.

p^l(x) = softmax(W_U . norm(h_l(x)))[options]; for the last layer this is exactly the model's
own output (HF decoders apply `norm` once after the last layer and then the unembedding).
"""

from __future__ import annotations

import torch
from torch import nn

from calm_lightning.models.calibrated_lm import positions_from_mask


def _unwrap(lm: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (if any)."""
    get_base = getattr(lm, "get_base_model", None)
    return get_base() if callable(get_base) else lm


def decoder_parts(lm: nn.Module) -> tuple[nn.ModuleList, nn.Module, nn.Module]:
    """(decoder layers, final norm, unembedding) of a decoder-only HF causal LM."""
    model = _unwrap(lm)
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    decoder = getattr(decoder, "language_model", decoder)  # multimodal wrappers (Gemma 3)
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    head = model.get_output_embeddings()
    if layers is None or norm is None or head is None:
        raise ValueError(
            f"logit lens: cannot find decoder layers, final norm and unembedding in "
            f"{type(model).__name__} (expected model.get_decoder().layers / .norm)"
        )
    return layers, norm, head


def _softcap(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    # Gemma-style final logit soft-capping is part of the model's output map.
    config = getattr(_unwrap(model), "config", None)
    cap = getattr(getattr(config, "text_config", config), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


@torch.no_grad()
def lens_option_logits(
    lm: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    option_ids: torch.Tensor,
    with_embeddings: bool = False,
) -> torch.Tensor:
    """fp32 option logits (B, L, K) of every decoder layer's output at the last position.

    Prompts are left padded, so the last position is the answer slot of every row. With
    `with_embeddings` the embedding output is prepended as layer 0 (B, L + 1, K).
    """
    layers, norm, head = decoder_parts(lm)
    captured: list[torch.Tensor] = []

    def keep_last(_module, _args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        captured.append(hidden[:, -1])

    # The embedding runs before the first layer, so its capture (if asked) comes first.
    modules = ([_unwrap(lm).get_input_embeddings()] if with_embeddings else []) + list(layers)
    handles = [module.register_forward_hook(keep_last) for module in modules]
    try:
        lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions_from_mask(attention_mask),
            logits_to_keep=1,
            use_cache=False,
        )
    finally:
        for handle in handles:
            handle.remove()
    hidden = torch.stack(captured, dim=1)  # (B, L, H)
    option_ids = option_ids.to(hidden.device)
    # Only the option rows of the unembedding are needed: W_U[options] . norm(h).
    weight = head.weight.index_select(0, option_ids)
    logits = norm(hidden) @ weight.T
    if getattr(head, "bias", None) is not None:
        logits = logits + head.bias.index_select(0, option_ids)
    return _softcap(lm, logits.float())
