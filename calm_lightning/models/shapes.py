"""Released models' architecture dimensions, for `model=random model.shape=<name>`.

A model built from one of these with random weights costs what the released model costs per
step (time and memory do not depend on weight values), so a paper table can be priced on any
machine without downloading 7B checkpoints. Each entry is copied by hand from the model's
`config.json` on the Hugging Face Hub (the id in `source`); nothing is fetched at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from calm_lightning.errors import ConfigError


@dataclass(frozen=True)
class Shape:
    """One architecture: a transformers `model_type` and the config values that size it."""

    model_type: str  # the transformers config class (llama, qwen2, olmo2, mistral, gemma3_text)
    source: str  # where the numbers were read (a Hub id), or why there is none
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    head_dim: int | None = None  # None: hidden_size // num_heads
    extra: dict = field(default_factory=dict)  # architecture-specific config values

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads

    def config_kwargs(self) -> dict:
        """Keyword arguments for the transformers config class of `model_type`."""
        kwargs = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "head_dim": self.attention_head_dim,
            **self.extra,
        }
        # transformers 5 reads the RoPE base from rope_parameters; a llama3-style scaling adds
        # its own keys there.
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        rope.update(kwargs.pop("rope_scaling", {}))
        kwargs["rope_parameters"] = rope
        return kwargs


_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

SHAPES: dict[str, Shape] = {
    # Not a released model: a CPU-sized Llama (15.7 M parameters with the 49,152-token
    # SmolLM2 vocabulary) for smoke runs of the benchmarks and of the plan on a laptop.
    "small": Shape(
        "llama", "none (CPU-sized stand-in)", 256, 768, 4, 8, 4, 49152, 8192, 100000.0, 1e-5,
        True,
    ),
    "smollm2_135m": Shape(
        "llama", "HuggingFaceTB/SmolLM2-135M-Instruct", 576, 1536, 30, 9, 3, 49152, 8192,
        100000.0, 1e-5, True,
    ),
    "gemma3_1b": Shape(
        "gemma3_text", "google/gemma-3-1b-it", 1152, 6912, 26, 4, 1, 262144, 32768, 1000000.0,
        1e-6, True, head_dim=256,
        extra={
            "sliding_window": 512,
            "query_pre_attn_scalar": 256,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "qwen25_1p5b": Shape(
        "qwen2", "Qwen/Qwen2.5-1.5B-Instruct", 1536, 8960, 28, 12, 2, 151936, 32768, 1000000.0,
        1e-6, True,
    ),
    "qwen25_7b": Shape(
        "qwen2", "Qwen/Qwen2.5-7B-Instruct", 3584, 18944, 28, 28, 4, 152064, 32768, 1000000.0,
        1e-6, False,
    ),
    "qwen25_14b": Shape(
        "qwen2", "Qwen/Qwen2.5-14B-Instruct", 5120, 13824, 48, 40, 8, 152064, 32768, 1000000.0,
        1e-6, False,
    ),
    # The language model of the multimodal checkpoint (its text_config); the 417M SigLIP
    # encoder is left out. Its linear RoPE scaling (factor 8) changes no cost and is omitted.
    "gemma3_27b": Shape(
        "gemma3_text", "google/gemma-3-27b-it (text_config)", 5376, 21504, 62, 32, 16, 262208,
        131072, 1000000.0, 1e-6, True, head_dim=128,
        extra={
            "sliding_window": 1024,
            "query_pre_attn_scalar": 168,
            "hidden_activation": "gelu_pytorch_tanh",
        },
    ),
    "olmo2_7b": Shape(
        "olmo2", "allenai/OLMo-2-1124-7B-DPO", 4096, 11008, 32, 32, 32, 100352, 4096, 500000.0,
        1e-6, False,
    ),
    "llama2_7b": Shape(
        "llama", "lmsys/vicuna-7b-v1.5 (Llama-2-7B)", 4096, 11008, 32, 32, 32, 32000, 4096,
        10000.0, 1e-5, False,
    ),
    "llama31_8b": Shape(
        "llama", "meta-llama/Llama-3.1-8B-Instruct", 4096, 14336, 32, 32, 8, 128256, 131072,
        500000.0, 1e-5, False, extra={"rope_scaling": _LLAMA31_ROPE},
    ),
    "mistral_7b": Shape(
        "mistral", "HuggingFaceH4/zephyr-7b-beta (Mistral-7B-v0.1)", 4096, 14336, 32, 32, 8,
        32000, 32768, 10000.0, 1e-5, False, extra={"sliding_window": 4096},
    ),
}  # fmt: skip


def get_shape(name) -> Shape:
    """The named shape, or a ConfigError listing the known ones."""
    if name not in SHAPES:
        raise ConfigError(
            f"model.shape={name!r} is not a known architecture shape; choose one of "
            f"{', '.join(SHAPES)} (calm_lightning/models/shapes.py)"
        )
    return SHAPES[name]


def parameter_count(shape: Shape) -> int:
    """The number of parameters a model of this shape has, from its dimensions alone."""
    h, d = shape.hidden_size, shape.attention_head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    attention = h * q + 2 * h * kv + q * h
    norms = 2 * h  # before attention and before the MLP (OLMo 2: after each instead)
    if shape.model_type == "qwen2":
        attention += q + 2 * kv  # biases on the q, k, v projections
    if shape.model_type == "olmo2":
        norms += q + kv  # RMSNorm over the whole query and key projections
    if shape.model_type == "gemma3_text":
        norms = 4 * h + 2 * d  # sandwich norms around both blocks; per-head q and k norms
    layer = attention + 3 * h * shape.intermediate_size + norms
    embeddings = shape.vocab_size * h * (1 if shape.tie_word_embeddings else 2)
    return embeddings + shape.num_layers * layer + h  # + the final norm
