"""What a model node means before anything loads (calm_lightning/models/model_node.py): its
parameter count, the quantization `auto` resolves to on a machine, and whether its Hub revision
is pinned. Torch-free: the planner and the preflight ask the same functions."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calm_lightning.errors import ConfigError
from calm_lightning.models import model_node
from calm_lightning.models.model_node import (
    choose_quantization,
    model_parameters,
    planned_quantization,
    quantization_available,
    revision_note,
    revision_pinned,
)

ROOT = Path(__file__).resolve().parents[1]
TULU = {"name": "tulu", "source": "hub", "model_id": "allenai/Llama-3.1-Tulu-3-8B-DPO",
        "quantization": "auto", "revision": None}  # fmt: skip
SMOLLM2_HUB = {"name": "smollm2", "source": "hub", "model_id": "x/y", "quantization": "auto"}


def test_the_parameter_count_comes_from_the_models_shape():
    # Llama-3.1-8B by hand: two 128,256 x 4096 embeddings; per layer q, o 4096 x 4096, k, v
    # 4096 x 1024, three 4096 x 14,336 MLP matrices and two norms; 32 layers and a final norm.
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    assert model_parameters(TULU) == 2 * 128256 * 4096 + 32 * layer + 4096 == 8_030_261_248
    assert model_parameters({"name": "no-such-model", "source": "hub"}) is None


@pytest.mark.parametrize(
    ("cuda", "bnb", "parameters", "mode"),
    [(True, True, 8_030_261_248, "nf4"), (False, False, 8_030_261_248, "none"),
     (False, True, 8_030_261_248, "none"), (True, False, 134_515_008, "none"),
     (True, False, None, "none"), (True, False, 2_999_999_999, "none")],
)  # fmt: skip
def test_auto_is_nf4_on_cuda_with_bitsandbytes_else_unquantized(cuda, bnb, parameters, mode):
    choice = choose_quantization("auto", cuda=cuda, bitsandbytes=bnb, parameters=parameters)
    assert choice.mode == mode and "model.quantization=auto" in choice.reason


def test_auto_on_cuda_without_bitsandbytes_refuses_3b_and_more_with_the_install_command():
    for parameters in (3_000_000_000, 8_030_261_248):
        with pytest.raises(ConfigError) as err:
            choose_quantization("auto", cuda=True, bitsandbytes=False, parameters=parameters)
        message = str(err.value)
        assert "\n" not in message and "pip install -e '.[quant]'" in message
        assert "pip install bitsandbytes" in message and "model.quantization=none" in message
    # an explicit none still runs bf16 there; nf4 needs both CUDA and bitsandbytes
    none = choose_quantization("none", cuda=True, bitsandbytes=False, parameters=8 * 10**9)
    assert none.mode == "none"
    with pytest.raises(ConfigError, match="needs bitsandbytes"):
        choose_quantization("nf4", cuda=True, bitsandbytes=False, parameters=None)
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        choose_quantization("nf4", cuda=False, bitsandbytes=True, parameters=None)
    with pytest.raises(ConfigError, match=r"reference_model\.quantization=auto"):
        choose_quantization("auto", cuda=True, bitsandbytes=False, parameters=7 * 10**9,
                            key="reference_model")  # fmt: skip


def test_the_plan_assumes_the_gpu_install_and_the_preflight_checks_it_here():
    planned = planned_quantization(TULU)
    assert planned.four_bit and "refused" in planned.reason
    assert not planned_quantization({**TULU, "quantization": "none"}).four_bit
    assert not planned_quantization({"name": "tiny", "source": "tiny"}).four_bit
    # a machine with CUDA and bitsandbytes holds the assumption; one without refuses Tulu
    assert quantization_available(TULU, cuda=True, bitsandbytes=True)[0]
    held, why = quantization_available(TULU, cuda=True, bitsandbytes=False)
    assert not held and "pip install -e '.[quant]'" in why
    # a small model without bitsandbytes loads, but not as planned (bf16, not nf4)
    held, why = quantization_available(SMOLLM2_HUB, cuda=True, bitsandbytes=False)
    assert not held and why.startswith("planned nf4")
    # `none` holds anywhere, and the default looks for bitsandbytes here
    assert quantization_available({**TULU, "quantization": "none"}, cuda=False)[0]
    assert quantization_available(TULU)[0] == model_node.bitsandbytes_installed()


@pytest.mark.parametrize(
    ("node", "pinned"),
    [({"source": "hub", "revision": None}, False), ({"source": "hub", "revision": "main"}, False),
     ({"source": "hub", "revision": "v1.0"}, False), ({"source": "hub", "revision": "abc1234"},
                                                      False),
     ({"source": "hub", "revision": "0123456789abcdef0123456789abcdef01234567"}, True),
     ({"source": "hub", "revision": None, "local_path": "/models/x"}, True),
     ({"source": "embedded", "revision": None}, True), ({"source": "tiny"}, True)],
)  # fmt: skip
def test_only_a_commit_a_saved_copy_or_no_download_is_pinned(node, pinned):
    assert revision_pinned(node) is pinned
    assert (revision_note({**node, "name": "x", "model_id": "o/x"}) is None) is pinned


def test_every_hub_model_config_has_a_documented_revision_key():
    """The one place a revision is pinned: `revision:` in each hub model's config, with a
    comment pointing at the documentation. No hash is invented here: unknown ones stay null
    and are warned about."""
    for group in ("model", "reference_model"):
        for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
            node = OmegaConf.to_container(OmegaConf.load(path))
            if node.get("source") != "hub":
                continue
            assert "revision" in node, path.name
            line = next(x for x in path.read_text().splitlines() if x.startswith("revision:"))
            assert "40 hex digits" in line, path.name
            assert node["revision"] is None or revision_pinned(node), path.name
            if node["revision"] is None:
                note = revision_note(node, group)
                assert f"conf/{group}/{path.stem}.yaml" in note
