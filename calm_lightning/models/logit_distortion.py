"""A known per-token miscalibration that no temperature can undo: `model.logit_distortion`.

The output layer's logits become z~ = k z + b 1[y in S+]: k is `model.logit_scale` (applied in
the final norm's weight, models/loading.py, so before the output layer) and b is added after
the output layer by a forward hook on it (`get_output_embeddings()`, tied or not). Every path
that reads logits runs the output layer (cloze's shared-prompt fast path, letter scoring,
training, sampling), so all of them see the same distorted model; `raw_logits` alone would
miss the cloze fast path and sampling, which call the LM directly.

S+ (`tokens: options`) is a seeded share (`fraction`) of the option-text tokens of the run's
MCQA **test** split: every token id of every option's continuation as cloze scoring encodes it
(data/cloze_batches.py `encode_question`, the run's `evaluation.cloze.prompt`), special tokens
left out. The test split alone, so that S+ is a function of what the base-cache fingerprint
already holds (the model block, the scored records, the code) and two settings that share the
test data (`demo` and `demo_id`) distort the same tokens. `tokens: [ids]` draws S+ from the
listed ids instead. Ground truth of the inverse head: d* = 1 / k everywhere, l* = -b / k on S+
and 0 elsewhere (`LogitDistortion.inverse`).

The hook is not in the weights: an export of a distorted run is refused
(exported/saved_run.py), and loading a model with the key set but no resolved S+ is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from calm_lightning.config_rules import Either, Keys, ListOf, Number, OneOf, check_values
from calm_lightning.errors import ConfigError

KEY = "logit_distortion"
# The node's defaults: a key left out takes these.
DEFAULTS = {"tokens": "options", "fraction": 0.5, "seed": 0, "bias": 0.0}
# The `model.logit_distortion` keys (null = off), merged into the model's rule table.
DISTORTION_RULES = {
    KEY: Keys(tuple(DEFAULTS)),
    f"{KEY}.tokens": Either(
        (OneOf(("options",)), ListOf(Number(minimum=0, integer=True), nonempty=True)),
    ),
    f"{KEY}.fraction": Number(minimum=0, maximum=1, exclusive_minimum=True),
    f"{KEY}.seed": Number(integer=True),
    f"{KEY}.bias": Number(finite=True),
}
# Where the installed distortion is recorded on the loaded model (a plain attribute, never in
# a state dict or a saved folder).
ATTRIBUTE = "calm_logit_distortion"


@dataclass(frozen=True)
class LogitDistortion:
    """What a run's model computes: z~ = scale * z + bias on `token_ids` (S+)."""

    token_ids: tuple[int, ...]  # S+, sorted
    bias: float  # b
    scale: float = 1.0  # k (model.logit_scale, in the weights)
    candidates: int = 0  # how many token ids S+ was drawn from

    def inverse(self, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(d*, l*): the head d * z~ + l that gives back z (fp32, vocabulary size)."""
        scale = torch.full((vocab_size,), 1.0 / self.scale, dtype=torch.float32)
        bias = torch.zeros(vocab_size, dtype=torch.float32)
        if self.token_ids:
            bias[list(self.token_ids)] = -self.bias / self.scale
        return scale, bias

    def record(self) -> dict:
        """The ground truth for metrics.json (`logit_distortion`)."""
        return {
            "bias": self.bias,
            "logit_scale": self.scale,
            "n_tokens": len(self.token_ids),
            "n_candidates": self.candidates,
            "token_ids": list(self.token_ids),
        }


def distortion_settings(model_cfg: dict) -> dict | None:
    """The `model.logit_distortion` node with its defaults filled in (None = off), checked."""
    node = model_cfg.get(KEY)
    if node is None:
        return None
    check_values("model", {KEY: node}, DISTORTION_RULES)
    return {**DEFAULTS, **dict(node)}


def resolve_distortion(
    model_cfg: dict, tokenizer, test_records, prompt: str = "chat"
) -> LogitDistortion | None:
    """S+ and b of a run (None = off), from the tokenizer and the MCQA test records: refused
    with the key named when an id is not the tokenizer's or nothing is left to distort."""
    from calm_lightning.data.cloze_batches import option_text_ids

    settings = distortion_settings(model_cfg)
    if settings is None:
        return None
    tokens, where = settings["tokens"], f"model.{KEY}"
    vocab = len(tokenizer)
    if tokens == "options":
        candidates = option_text_ids(tokenizer, test_records, prompt, special=False)
        if not candidates:
            raise ConfigError(
                f"{where}.tokens=options: the test split has no multiple-choice option text "
                "tokens (an open-QA test split, or only special tokens); list the token ids "
                f"to distort ({where}.tokens=[...]) or use an MCQA test split"
            )
    else:
        candidates = sorted({int(t) for t in tokens})
        unknown = [t for t in candidates if t >= vocab]
        if unknown:
            raise ConfigError(
                f"{where}.tokens holds ids {unknown[:5]} that the tokenizer does not have (its "
                f"ids are 0 to {vocab - 1}); list ids of this model's tokenizer"
            )
    n = int(round(settings["fraction"] * len(candidates)))
    if n == 0:
        raise ConfigError(
            f"{where}.fraction={settings['fraction']} of {len(candidates)} candidate token(s) "
            f"leaves no token to distort; raise {where}.fraction or give more tokens"
        )
    generator = torch.Generator().manual_seed(int(settings["seed"]))
    order = torch.randperm(len(candidates), generator=generator)[:n]
    chosen = tuple(sorted(candidates[i] for i in order.tolist()))
    scale = float(model_cfg.get("logit_scale", 1.0))
    return LogitDistortion(chosen, float(settings["bias"]), scale, len(candidates))


def install_distortion(model: torch.nn.Module, distortion: LogitDistortion) -> None:
    """Add b to the S+ logits after the output layer (a forward hook) and record the
    distortion on `model`. Runs after `apply_logit_scale`: the scale acts inside the layer's
    input, so the output is exactly k z + b on S+."""
    layer = model.get_output_embeddings()
    vocab = layer.weight.shape[0]
    if distortion.token_ids and max(distortion.token_ids) >= vocab:
        raise ConfigError(
            f"model.{KEY}: token id {max(distortion.token_ids)} is beyond the output layer's "
            f"{vocab} entries; list ids of this model's vocabulary"
        )
    setattr(model, ATTRIBUTE, distortion)
    if not distortion.token_ids or distortion.bias == 0.0:
        return
    shift = torch.zeros(vocab, dtype=torch.float32)
    shift[list(distortion.token_ids)] = distortion.bias
    cached: dict = {}

    def add_bias(module, inputs, output):
        key = (output.device, output.dtype)
        if key not in cached:
            cached[key] = shift.to(device=output.device, dtype=output.dtype)
        return output + cached[key]

    layer.register_forward_hook(add_bias)


def installed_distortion(model: torch.nn.Module) -> LogitDistortion | None:
    """The distortion `install_distortion` recorded on `model` (through a PEFT wrapper too)."""
    for candidate in (model, getattr(model, "get_base_model", lambda: None)()):
        found = getattr(candidate, ATTRIBUTE, None) if candidate is not None else None
        if isinstance(found, LogitDistortion):
            return found
    return None
