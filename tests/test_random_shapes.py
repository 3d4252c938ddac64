"""`model=random model.shape=...`: released architectures' dimensions with random weights, and
the byte-level tokenizer that lets them (and `model=tiny`) run without the embedded wheel."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from calm_lightning.errors import ConfigError
from calm_lightning.models import shapes
from calm_lightning.models.byte_tokenizer import build_byte_tokenizer
from calm_lightning.models.loading import load_language_model, random_model_config

ROOT = Path(__file__).resolve().parents[1]

# Parameter totals the released checkpoints report (their model cards / safetensors metadata),
# independent of the dimensions written in shapes.py.
PUBLISHED_PARAMETERS = {
    "smollm2_135m": 134_515_008,
    "gemma3_1b": 999_885_952,
    "qwen25_1p5b": 1_543_714_304,
    "qwen25_7b": 7_615_616_512,
    "qwen25_14b": 14_770_033_664,  # the model card's 14.7B (13.1B without embeddings)
    # Gemma 3 report, Table 1: 25,600M non-embedding + 1,416M embedding parameters (rounded,
    # the vision encoder apart); the count here is 25,599.7M + 262,208 x 5,376 = 1,409.6M.
    "gemma3_27b": 27_009_346_304,
    "olmo2_7b": 7_298_617_344,
    "llama2_7b": 6_738_415_616,
    "llama31_8b": 8_030_261_248,
    "mistral_7b": 7_241_732_096,
}


def test_every_released_shape_has_its_published_parameter_count():
    assert set(PUBLISHED_PARAMETERS) == set(shapes.SHAPES) - {"small"}
    for name, count in PUBLISHED_PARAMETERS.items():
        assert shapes.parameter_count(shapes.SHAPES[name]) == count, name


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_the_built_architecture_has_the_counted_parameters(name):
    """transformers' own class for the architecture, on the meta device (no memory), has
    exactly the parameters the formula counts from the dimensions."""
    from transformers import AutoModelForCausalLM

    shape = shapes.SHAPES[name]
    config = random_model_config({"shape": name}, tokenizer_size=259)
    assert config.model_type == shape.model_type and config.vocab_size == shape.vocab_size
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == shapes.parameter_count(shape)
    assert model.get_output_embeddings().weight.shape == (shape.vocab_size, shape.hidden_size)


def test_byte_tokenizer_is_utf8_bytes_with_chatml_markers():
    tokenizer = build_byte_tokenizer()
    text = "Héllo, wörld ✓\n A. B."
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 259
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    encoded = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert encoded[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") >= 256
    assert tokenizer.decode(encoded) == prompt
    for letter in "ABCD":  # letter scoring needs one token per option letter
        assert tokenizer(letter, add_special_tokens=False)["input_ids"] == [ord(letter)]


def test_small_shape_builds_with_its_own_vocabulary_and_the_byte_tokenizer():
    loaded = load_language_model(
        {"name": "r", "source": "tiny", "shape": "small", "tokenizer": "bytes", "dtype": "auto"}
    )
    shape = shapes.SHAPES["small"]
    model = loaded.model
    assert sum(p.numel() for p in model.parameters()) == shapes.parameter_count(shape)
    assert loaded.dtype == torch.float32 and not loaded.quantized  # CPU: fp32, never nf4
    ids = loaded.tokenizer("ABC", return_tensors="pt")
    logits = model(**ids).logits
    # The released vocabulary size, not the tokenizer's 259: the output layer costs what it does.
    assert logits.shape == (1, 3, shape.vocab_size)
    assert model.config.eos_token_id == loaded.tokenizer.eos_token_id
    again = load_language_model({"source": "tiny", "shape": "small", "tokenizer": "bytes"})
    assert torch.equal(again.model.lm_head.weight, model.lm_head.weight)  # private seed


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(monkeypatch):
    narrow = dataclasses.replace(shapes.SHAPES["small"], vocab_size=100)
    monkeypatch.setitem(shapes.SHAPES, "narrow", narrow)
    with pytest.raises(ConfigError, match="model.tokenizer=bytes"):
        load_language_model({"source": "tiny", "shape": "narrow", "tokenizer": "bytes"})


@pytest.mark.integration
def test_an_unknown_shape_stops_the_run_before_the_model_loads(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-m", "calm_lightning.run", "model=random", "model.shape=olmo3_7b",
         f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120, env=env, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode != 0
    assert "model.shape='olmo3_7b' is not a known architecture shape" in done.stderr
    assert "olmo2_7b" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "metrics.json").exists()
