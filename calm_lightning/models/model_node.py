"""What a `conf/model/*.yaml` (or `conf/reference_model/*.yaml`) node means before anything
loads, without torch: the architecture and parameter count it runs (from models/shapes.py),
the quantization `auto` resolves to on a machine, and whether its Hub revision is pinned.

The loader (models/loading.py), the config checks (validation.py), the planner and the
preflight all ask these functions, so that a refusal the loader would make is said first by
the config check, and the plan assumes what a run will do.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass

from calm_lightning.errors import ConfigError
from calm_lightning.models.shapes import SHAPES, Shape, parameter_count

# The Hugging Face model each configured model (conf/model, conf/reference_model) runs: its
# shape in models/shapes.py. Tulu 3 8B fine-tunes Llama-3.1-8B (8 added vocabulary rows: no
# difference at this precision); the base (pre-trained) references share their chat models'.
MODEL_SHAPES = {
    "olmo2": "olmo2_7b",
    "vicuna": "llama2_7b",
    "tulu": "llama31_8b",
    "mistral": "mistral_7b",
    "smollm2": "smollm2_135m",
    "llama31_8b_instruct": "llama31_8b",
    "llama31_8b": "llama31_8b",
    "qwen25_1p5b_instruct": "qwen25_1p5b",
    "qwen25_1p5b": "qwen25_1p5b",
    "qwen25_7b_instruct": "qwen25_7b",
    "qwen25_7b": "qwen25_7b",
    "qwen25_14b_instruct": "qwen25_14b",
    "qwen25_14b": "qwen25_14b",
    "gemma3_1b_it": "gemma3_1b",
    "gemma3_1b": "gemma3_1b",
    "gemma3_27b_it": "gemma3_27b",
    "gemma3_27b": "gemma3_27b",
}
# model=tiny's dimensions when its config leaves them out (models/loading.py's defaults).
TINY_DEFAULTS = {
    "hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4,
    "num_kv_heads": 2,
}  # fmt: skip
TINY_VOCABULARY = 49152  # model=tiny / tiny_plm: the embedded SmolLM2 tokenizer's vocabulary

# From this many parameters `quantization: auto` on a CUDA GPU means nf4 QLoRA and nothing else:
# without bitsandbytes such a model is refused instead of falling back to bf16 LoRA, whose
# weights alone are 2 bytes per parameter (Tulu 3 8B's CALM peak: 37.1 GiB, not 29.4) and
# which is not the paper's QLoRA. Smaller models keep the fallback (with a warning): in bf16
# they fit any GPU the plan lists. The same boundary as `peft.gradient_checkpointing=auto`.
QLORA_FROM = 3_000_000_000
INSTALL_QUANT = "pip install -e '.[quant]' (or pip install bitsandbytes)"
# A Hub commit: 40 hexadecimal digits. A branch or tag name can move, so it is not a pin.
COMMIT = re.compile(r"[0-9a-f]{40}")


def model_shape(model: dict) -> Shape | None:
    """The shape a composed `model` (or `reference_model`) node runs, None when unknown."""
    if model.get("shape"):
        return SHAPES.get(str(model["shape"]))
    if model.get("source") == "tiny":
        tiny = model.get("tiny") or {}
        dims = [_size(tiny, key, default) for key, default in TINY_DEFAULTS.items()]
        return Shape("llama", "model=tiny", *dims, TINY_VOCABULARY, 1024, 10000.0, 1e-5, True)
    name = MODEL_SHAPES.get(str(model.get("name")))
    return SHAPES[name] if name else None


def _size(node: dict, key: str, default: int) -> int:
    """A tiny model's dimension; an unresolved interpolation (a config read without its
    parent) counts as the loader's default."""
    value = node.get(key, default)
    return int(value) if str(value).isdigit() else default


def model_parameters(model: dict) -> int | None:
    """The parameters of the model a node loads, from its shape (None: not in the tables; the
    loader then counts them from the checkpoint's config.json before the weights load)."""
    shape = model_shape(model)
    return parameter_count(shape) if shape is not None else None


def bitsandbytes_installed() -> bool:
    """Whether bitsandbytes can be imported here (found, not imported: no torch, no CUDA)."""
    return importlib.util.find_spec("bitsandbytes") is not None


@dataclass(frozen=True)
class Quantization:
    """What a node's `quantization` resolves to: `mode` nf4 or none, and why."""

    mode: str
    reason: str

    @property
    def four_bit(self) -> bool:
        return self.mode == "nf4"


def choose_quantization(value: str, *, cuda: bool, bitsandbytes: bool,
                        parameters: int | None, key: str = "model") -> Quantization:  # fmt: skip
    """The loader's rule for `<key>.quantization=<value>` on a machine with or without CUDA and
    bitsandbytes, for a model of `parameters` parameters (None: unknown, treated as small).
    Raises the one-line ConfigError the run stops with where it cannot load as asked."""
    if value == "none":
        return Quantization("none", f"{key}.quantization=none: the model's dtype, no 4-bit")
    if value == "nf4":
        if not cuda:
            # On CPU bitsandbytes 4-bit runs but inference before training silently breaks
            # LoRA gradients (docs/platform.md), so we refuse rather than train nothing.
            raise ConfigError(
                f"{key}.quantization=nf4 needs a CUDA GPU; on CPU use {key}.quantization=none "
                "(or auto, which picks fp32 LoRA on CPU)."
            )
        if not bitsandbytes:
            raise ConfigError(f"{key}.quantization=nf4 needs bitsandbytes: {INSTALL_QUANT}")
        return Quantization("nf4", f"{key}.quantization=nf4: 4-bit QLoRA")
    if not cuda:
        return Quantization("none", f"{key}.quantization=auto on a CPU: no 4-bit (fp32)")
    if bitsandbytes:
        return Quantization("nf4", f"{key}.quantization=auto on a CUDA GPU with bitsandbytes")
    if parameters is not None and parameters >= QLORA_FROM:
        raise ConfigError(
            f"{key}.quantization=auto on a CUDA GPU without bitsandbytes: a model of "
            f"{parameters / 1e9:.1f}B parameters runs as the paper's 4-bit QLoRA; install it "
            f"({INSTALL_QUANT}) or set {key}.quantization=none for bf16 LoRA"
        )
    return Quantization(
        "none",
        f"{key}.quantization=auto on a CUDA GPU without bitsandbytes: bf16 LoRA (a model under "
        f"{QLORA_FROM / 1e9:.0f}B parameters; {INSTALL_QUANT} for 4-bit)",
    )


def planned_quantization(model: dict, key: str = "model") -> Quantization:
    """What the plan assumes a node loads as on the GPU it plans for: the loader's rule on a
    CUDA machine with bitsandbytes (the documented GPU install), since without it a model of
    3B or more is refused before it loads and a run that starts runs what is planned."""
    value = str(model.get("quantization", "none" if model.get("source") == "tiny" else "auto"))
    if model.get("source") == "tiny" and not model.get("shape"):
        return Quantization("none", "model=tiny is never quantized (fp32)")
    choice = choose_quantization(value, cuda=True, bitsandbytes=True,
                                 parameters=model_parameters(model), key=key)  # fmt: skip
    if value != "auto":
        return choice
    parameters = model_parameters(model)
    if parameters is not None and parameters >= QLORA_FROM:
        return Quantization("nf4", f"{choice.reason}; without it a model this size is refused")
    return Quantization("nf4", f"{choice.reason}; without it bf16 LoRA runs, not priced here")


def quantization_available(model: dict, *, cuda: bool = True, bitsandbytes: bool | None = None,
                           key: str = "model") -> tuple[bool, str]:  # fmt: skip
    """Whether the plan's assumption for a node (`planned_quantization`) holds on a machine
    with (`cuda`) or without a CUDA GPU and with or without bitsandbytes (None: look here):
    (True, what it loads as) or (False, why not, the refusal's message included)."""
    planned = planned_quantization(model, key)
    has_bnb = bitsandbytes_installed() if bitsandbytes is None else bitsandbytes
    value = str(model.get("quantization", "none" if model.get("source") == "tiny" else "auto"))
    if model.get("source") == "tiny" and not model.get("shape"):
        return True, planned.reason
    try:
        here = choose_quantization(value, cuda=cuda, bitsandbytes=has_bnb,
                                   parameters=model_parameters(model), key=key)  # fmt: skip
    except ConfigError as err:
        return False, str(err)
    if here.mode != planned.mode:
        return False, f"planned {planned.mode}, but here {here.reason}"
    return True, here.reason


def revision_pinned(model: dict) -> bool:
    """Whether the weights a node reads cannot change under a sweep: a Hub model pinned to a
    commit (`revision`: 40 hex digits; a branch or tag can move), a saved copy
    (`local_path`), the embedded wheel's file or random weights (nothing downloaded)."""
    if model.get("local_path") or model.get("source") != "hub":
        return True
    return bool(COMMIT.fullmatch(str(model.get("revision") or "")))


def revision_note(model: dict, key: str = "model") -> str | None:
    """A warning line for a node whose revision is not pinned (None when it is)."""
    if revision_pinned(model):
        return None
    revision = model.get("revision")
    moving = f"revision {revision!r} is a branch or tag" if revision else "no revision pinned"
    return (
        f"{key}={model.get('name')} ({model.get('model_id')}): {moving}, so the Hub's "
        f"current files are read; pin a commit with `revision:` in "
        f"conf/{key}/{model.get('name')}.yaml (multirun_sweeps/README.md, pinning revisions)"
    )
