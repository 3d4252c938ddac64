"""Shared fixtures: offline environment, config composition and the tiny model."""

from __future__ import annotations

import os

# Nothing in the test suite may reach the Hugging Face Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_module  # noqa: E402

import calm_lightning.resolvers  # noqa: E402, F401  (registers resolvers)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def compose_run(overrides: list[str] | None = None, output_dir=None):
    """Compose the primary config like `python -m calm_lightning.run` would."""
    overrides = list(overrides or [])
    if output_dir is not None:
        overrides.append(f"paths.output_dir={output_dir}")
    with initialize_config_module("calm_lightning.conf", version_base="1.3"):
        return compose("run", overrides=overrides)


@pytest.fixture(scope="session")
def tiny_loaded():
    """The tiny random Llama with the embedded tokenizer (built once per session)."""
    from calm_lightning.models.loading import load_language_model

    cfg = compose_run(["model=tiny", "paths.output_dir=/tmp/unused"])
    return load_language_model(cfg.model)


@pytest.fixture(scope="session")
def tokenizer(tiny_loaded):
    return tiny_loaded.tokenizer
