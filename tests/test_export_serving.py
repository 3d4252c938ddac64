"""What servers other than transformers get from an export, and what leaves the machine with
it: a folded export written as a llama.cpp-style GGUF (gguf-py's own tensor names, the tied
output left out as llama.cpp's converter leaves it) reads back calibrated; a DACA run of a
model loaded from `model.local_path`, over-confident by `model.logit_scale=4`, exports without
any local path and with its logit scale on record."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from calm_lightning.errors import ConfigError, ExportError
from calm_lightning.exported.writer import export_run
from calm_lightning.pipeline import run_experiment

ROOT = Path(__file__).resolve().parents[1]
PROBE_IDS = [[5, 17, 300, 41, 9, 1200], [88, 7, 7, 2301, 15, 4]]
TEMPERATURE = 2.5


def _permute_for_gguf(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a q / k projection: each head's two halves interleaved
    (transformers' GGUF reader undoes it)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _write_llama_gguf(folder: Path, path: Path) -> set[str]:
    """The folder's safetensors as a llama GGUF, named by gguf-py's tensor map (llama.cpp's
    own); returns the tensor names written."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("calibrated")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    written = set()
    for name, tensor in load_file(folder / "model.safetensors").items():
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        array = tensor.float().numpy()
        if target.endswith("attn_q.weight"):
            array = _permute_for_gguf(array, config["num_attention_heads"])
        elif target.endswith("attn_k.weight"):
            array = _permute_for_gguf(array, config["num_key_value_heads"])
        writer.add_tensor(target, np.ascontiguousarray(array))
        written.add(target)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.mark.integration
def test_a_folded_export_as_gguf_reads_back_calibrated(tmp_path, compose):
    """The tiny model (tied embeddings) with a temperature folded in, saved as the export saves
    it, then as GGUF: no `output.weight` (llama.cpp then uses the token embedding, as for any
    tied model), `output_norm.weight` carrying 1 / T, and transformers' GGUF reader gives
    softmax(z / T) to 1e-5. Not llama.cpp itself: its tensor names and layout only."""
    from transformers import AutoModelForCausalLM

    from calm_lightning.exported.folding import fold_head
    from calm_lightning.models.loading import load_language_model
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    model = load_language_model(compose(["model=tiny"]).model).model.eval()
    ids = torch.tensor(PROBE_IDS)
    with torch.no_grad():
        expected = torch.softmax(model(input_ids=ids).logits / TEMPERATURE, dim=-1)
        untouched = torch.softmax(model(input_ids=ids).logits, dim=-1)
    head = LogitAdjustment(model.config.vocab_size, kind="scalar")
    with torch.no_grad():
        head.scale.fill_(1.0 / TEMPERATURE)
    fold_head(model, head, ids)
    folder = tmp_path / "folded"
    model.save_pretrained(folder)
    written = _write_llama_gguf(folder, folder / "model.gguf")
    assert "output.weight" not in written and "output_norm.weight" in written
    served = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file="model.gguf", dtype=torch.float32
    ).eval()
    assert served.config.tie_word_embeddings
    with torch.no_grad():
        probs = torch.softmax(served(input_ids=ids).logits, dim=-1)
    torch.testing.assert_close(probs, expected, atol=1e-5, rtol=0)
    assert (untouched - expected).abs().max() > 1e-2  # the temperature matters here


def test_the_export_refuses_a_folder_holding_a_local_path(tmp_path):
    from calm_lightning.exported.model_card import _without_paths
    from calm_lightning.exported.private_paths import check_no_private_path, public_block

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_name_or_path": str(tmp_path / "m")}))
    check_no_private_path(folder, {"/somewhere/else"})
    with pytest.raises(ExportError, match="config.json would hold the local path"):
        check_no_private_path(folder, {str(tmp_path / "m")})
    block = {
        "module": {
            "model_config": {"name": "smollm2", "source": "embedded", "model_id": "org/m"},
            "reference_model": {"name": "tiny_plm", "source": "tiny", "model_id": None},
            "cache_dir": "/home/someone/.cache/calm",
            "lr": 0.05,
        }
    }
    assert public_block(block) == {
        "module": {
            "model_config": "org/m",
            "reference_model": "tiny_plm",
            "cache_dir": "<local path>",
            "lr": 0.05,
        }
    }
    summary = {"test": {"source": "/data/mmlu/test.jsonl", "files": ["/data/a.json"], "n": 3}}
    assert _without_paths(summary) == {
        "test": {"source": "test.jsonl", "files": ["a.json"], "n": 3}
    }


@pytest.fixture(scope="module")
def local_tiny(tmp_path_factory, compose) -> Path:
    """The tiny model and its tokenizer saved to a folder, as a `model.local_path` copy."""
    from calm_lightning.models.loading import load_language_model

    folder = tmp_path_factory.mktemp("saved") / "tiny-copy"
    loaded = load_language_model(compose(["model=tiny"]).model)
    loaded.model.save_pretrained(folder)
    loaded.tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.integration
def test_a_daca_run_from_a_local_path_exports_no_path_and_its_logit_scale(
    local_tiny, tmp_path, compose
):
    """Must-show: DACA on `model.local_path=<folder>` with `model.logit_scale=4` exports with
    no absolute path in any file, records the scale in calibration.json and the card, serves
    the run's predictions, and refuses to be loaded with the scale again."""
    from calm_lightning import load_calibrated
    from calm_lightning.models.loading import load_language_model

    run_dir = tmp_path / "daca_run"
    overrides = [
        "model=smollm2",  # a Hub-id model whose weights come from the local folder
        f"model.local_path={local_tiny}",
        "model.logit_scale=4.0",
        "reference_model=tiny_plm",
        "method=daca",
        "evaluation.scoring=letter",
        "setting=demo_posthoc",
        "setting.test.source.limit=40",
        "trainer.enable_progress_bar=false",
        "logger=none",
        f"method.module.cache_dir={tmp_path / 'lens cache'}",
    ]
    cfg = compose(overrides, run_dir)
    run_experiment(cfg)
    folder = export_run(run_dir, tmp_path / "export")
    private = {str(local_tiny), str(tmp_path), str(ROOT), str(Path.home()) + "/"}
    private |= {str(p) for p in (cfg.paths.cache_dir, os.environ.get("CALM_LIGHTNING_CACHE")) if p}
    for path in folder.rglob("*"):
        if path.is_file() and path.suffix in (".json", ".md", ".py", ".jinja", ".txt"):
            text = path.read_text()
            assert not [p for p in private if p in text], path.name
    config = json.loads((folder / "config.json").read_text())
    assert config.get("_name_or_path", cfg.model.model_id) == cfg.model.model_id
    assert config["tie_word_embeddings"] is True
    assert config["calm_lightning_logit_scale"] == 4.0  # travels with the weights (Hub too)
    info = json.loads((folder / "calibration.json").read_text())
    assert info["weights"]["logit_scale"] == 4.0
    assert info["serving"]["folded_into"] == "final_norm"
    card = (folder / "README.md").read_text()
    assert "**Logit scale 4:**" in card and "`weights.logit_scale`" in card
    assert f"model_config: {cfg.model.model_id}" in card and "reference_model: tiny" in card
    # The folded export serves the run's predictions (letter scoring, the head folded in).
    calibrated = load_calibrated(folder, device="cpu")
    records = [json.loads(line) for line in (run_dir / "predictions.jsonl").open()][:4]
    from hydra.utils import instantiate

    by_id = {r.id: r for r in instantiate(cfg.setting.test).load()}
    probs = [
        calibrated.option_probabilities(by_id[r["id"]].question, list(by_id[r["id"]].choices))
        for r in records
    ]
    np.testing.assert_allclose(np.array(probs), [r["probs"] for r in records], atol=1e-5)
    again = {**cfg.model, "local_path": str(folder), "logit_scale": 4.0}
    with pytest.raises(ConfigError, match="already carry logit_scale=4.0"):
        load_language_model(again)
    assert load_language_model({**again, "logit_scale": 1.0}).model is not None


SMALL = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "tie_word_embeddings": True,
}


@pytest.mark.parametrize(
    "model_type", ["llama", "mistral", "qwen2", "qwen3", "olmo2", "gemma3_text"]
)
def test_a_temperature_folds_into_each_listed_architectures_final_norm(model_type):
    """Random small models of each NORM_FORMS family (Gemma's (1 + w) norm included): the fold
    gives softmax(z / T) to 1e-5 and leaves the tied embedding one tensor, unchanged."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from calm_lightning.exported.folding import fold_head, fold_target
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **SMALL)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # away from the init (Gemma's w = 0, Llama's w = 1) and confident
        model.model.norm.weight.add_(torch.rand_like(model.model.norm.weight))
        model.get_input_embeddings().weight.mul_(20.0)
    ids = torch.tensor(PROBE_IDS) % SMALL["vocab_size"]
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    embedding = model.get_input_embeddings().weight.detach().clone()
    head = LogitAdjustment(SMALL["vocab_size"], kind="scalar")
    with torch.no_grad():
        head.scale.fill_(1.0 / TEMPERATURE)
    assert fold_target(head, model, adapted_output=False) == ("final_norm", None)
    fold_head(model, head, ids)
    with torch.no_grad():
        folded = torch.softmax(model(input_ids=ids).logits, dim=-1)
    torch.testing.assert_close(folded, torch.softmax(logits / TEMPERATURE, -1), atol=1e-5, rtol=0)
    assert (torch.softmax(logits, -1) - folded).abs().max() > 1e-3
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    torch.testing.assert_close(model.get_input_embeddings().weight, embedding, atol=0, rtol=0)


def test_a_soft_capped_gemma_2_is_not_folded():
    from transformers import AutoConfig, AutoModelForCausalLM

    from calm_lightning.exported.folding import fold_obstacle
    from calm_lightning.models.logit_adjustment import LogitAdjustment

    config = AutoConfig.for_model("gemma2", **SMALL)
    assert config.final_logit_softcapping  # 30.0: tanh after the output layer
    model = AutoModelForCausalLM.from_config(config)
    head = LogitAdjustment(SMALL["vocab_size"], kind="scalar")
    assert "final_logit_softcapping" in fold_obstacle(head, model, adapted_output=False)
