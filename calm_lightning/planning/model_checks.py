"""The preflight's checks of what a job's model will read, on the tokenizer and config.json
alone (planning/preflight.py runs them): BOS, the chat template, the letters' ids, the lengths
against the context; the vocabulary against the head, the LoRA targets on a meta-device copy of
the architecture, and the quantization the plan assumes."""

from __future__ import annotations

import json
from functools import lru_cache

from omegaconf import OmegaConf

from calm_lightning.planning.preflight_checks import (
    FAIL,
    PASS,
    SKIP,
    Check,
    Memo,
    guarded,
    node_key,
)


def check_tokenizer(cfg, memo: Memo) -> list[Check]:
    """BOS, option ids, chat template and lengths, on the tokenizer alone."""
    key = "tokenizer:" + node_key(cfg.model, cfg.evaluation, cfg.setting.get("max_length"))
    return memo.get(key, lambda: guarded("tokenizer", lambda: _tokenizer_rows(cfg)))


def _tokenizer_rows(cfg) -> list[Check]:

    model = OmegaConf.to_container(cfg.model, resolve=True)
    tokenizer = _tokenizer(model)
    rows = tokenizer_checks(tokenizer, cfg)
    context = _model_context(cfg)
    longest = max(
        int(cfg.setting.get("max_length") or 0), int(cfg.setting.get("eval_max_length") or 0)
    )
    rows.append(
        _at_most(
            "tokenizer.length", longest, context, "the model's context length is unknown here",
            f"setting max_length {longest} > the model's context {context}",
            f"{longest} <= context {context}",
        )
    )  # fmt: skip
    return rows


def _at_most(name: str, value: int, bound: int | None, unknown: str, over: str, within: str):
    """A bounded check: SKIP (`unknown`) without a bound, FAIL (`over`) above it, else PASS."""
    if bound is None:
        return Check(name, SKIP, unknown)
    return Check(name, FAIL, over) if value > bound else Check(name, PASS, within)


def tokenizer_checks(tokenizer, cfg) -> list[Check]:
    """What the model will be fed, on the tokenizer alone: BOS as the tokenizer's default says
    (once, first), the chat template renders and the prompt's ids are a prefix of prompt +
    answer, and under letter scoring the letters' ids as scored and as trained, from the joint
    encoding of prompt + letter (data/tokens.py, evaluation/mcqa.py)."""
    from calm_lightning.data.prompts import render_conversation
    from calm_lightning.data.tokens import adds_bos, encode_prompt, text_ids_after
    from calm_lightning.evaluation.mcqa import (
        answer_slot_prompt,
        option_token_candidates,
        training_letter_ids,
    )

    rows = []
    prompt = answer_slot_prompt(tokenizer)
    ids = encode_prompt(tokenizer, prompt)
    bos = tokenizer.bos_token_id
    if adds_bos(tokenizer):
        once = ids[:1] == [bos] and bos not in ids[1:]
        rows.append(
            Check(
                "tokenizer.bos",
                PASS if once else FAIL,
                f"BOS {bos} first, once"
                if once
                else f"BOS {bos} is not first exactly once in a rendered prompt",
            )
        )
    else:
        rows.append(Check("tokenizer.bos", PASS, "the tokenizer adds no BOS by default"))
    prompt, response = render_conversation(tokenizer, "Which is it?\nA. x\nB. y", "A")
    joined = text_ids_after(tokenizer, prompt, response) is not None
    rows.append(
        Check(
            "tokenizer.template",
            PASS if joined else FAIL,
            "the chat template renders; the prompt is a prefix of prompt + answer"
            if joined
            else "a token spans the prompt / answer boundary: the answer ids depend on the prompt",
        )
    )
    if OmegaConf.select(cfg, "evaluation.scoring", default="letter") != "letter":
        rows.append(Check("tokenizer.options", PASS, "cloze scoring reads option texts"))
        return rows
    scored = option_token_candidates(tokenizer, prompt=answer_slot_prompt(tokenizer))
    trained = training_letter_ids(tokenizer)
    spelled = "; ".join(f"{style}: {list(o.ids)}" for style, o in scored.items())
    rows.append(
        Check(
            "tokenizer.options",
            PASS,
            f"letters as scored ({spelled}), as trained {list(trained.ids)}",
        )
    )
    return rows


def _model_context(cfg) -> int | None:
    config = _model_config(OmegaConf.to_container(cfg.model, resolve=True))
    if config is None:
        return None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    text = getattr(config, "text_config", None)  # multimodal configs (Gemma 3)
    return getattr(text, "max_position_embeddings", None) if text is not None else None


def _tokenizer(model: dict):
    """The node's tokenizer, read once per process: the tokenizer checks, the tiny model's
    config and the vocabulary check all need it."""
    return _tokenizer_of(json.dumps(model, sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _tokenizer_of(model_json: str):
    from calm_lightning.models.loading import load_tokenizer

    return load_tokenizer(json.loads(model_json))


def _model_config(model: dict):
    """The transformers config the job's model would load with, without weights (None when
    it cannot be read here: the embedded model before its first conversion); read once per
    process per model node, since the context and the model checks both ask."""
    return _config_of(json.dumps(model, sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _config_of(model_json: str):
    model = json.loads(model_json)
    from transformers import AutoConfig

    from calm_lightning.models import embedded
    from calm_lightning.models.loading import random_model_config

    source = model.get("source")
    if source == "tiny":
        return random_model_config(model, len(_tokenizer(model)))
    if source == "embedded" and not model.get("local_path"):
        folder = embedded.converted_dir(model.get("cache_dir"))
        if not (folder / "config.json").is_file():
            return None
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    from calm_lightning.models.loading import _weights_location

    location, local_only = _weights_location(model)
    return AutoConfig.from_pretrained(
        location,
        revision=model.get("revision"),
        local_files_only=local_only,
        trust_remote_code=bool(model.get("trust_remote_code", False)),
    )


def check_model(cfg, memo: Memo) -> list[Check]:
    """config.json against the tokenizer, LoRA targets on a meta-device copy."""
    key = "model:" + node_key(cfg.model, cfg.get("peft"))
    return memo.get(key, lambda: guarded("model", lambda: _model_rows(cfg)))


def _model_rows(cfg) -> list[Check]:
    import torch
    from transformers import AutoModelForCausalLM

    from calm_lightning.models.lora import linear_layer_names

    model = OmegaConf.to_container(cfg.model, resolve=True)
    config = _model_config(model)
    if config is None:
        return [
            Check(
                "model",
                SKIP,
                "the embedded model is not converted yet (the demo converts it once: make demo)",
            )
        ]
    rows = []
    tokenizer = _tokenizer(model)
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None
    )
    rows.append(
        _at_most(
            "model.vocabulary", len(tokenizer), vocab, "config.json states no vocab_size",
            f"tokenizer has {len(tokenizer)} tokens, the head {vocab} rows",
            f"{len(tokenizer)} tokens <= {vocab} rows",
        )
    )  # fmt: skip
    peft = OmegaConf.to_container(cfg.peft, resolve=True) if cfg.get("peft") else {}
    if peft and peft.get("method", "lora") not in (None, "none"):
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        rows.append(
            _lora_targets(peft.get("target_modules", "all-linear"), linear_layer_names(meta))
        )
    return rows


def _lora_targets(targets, linear: list[str]) -> Check:
    if targets in ("all-linear", None):
        if not linear:
            return Check("model.lora", FAIL, "all-linear finds no linear layer")
        return Check("model.lora", PASS, f"all-linear: {len(linear)} layer names")
    wanted = [targets] if isinstance(targets, str) else list(targets)
    names = {name.split(".")[-1] for name in linear}
    missing = [t for t in wanted if t not in names]
    if missing:
        return Check(
            "model.lora",
            FAIL,
            f"peft.target_modules {missing} are not in the model "
            f"(its linear layers: {', '.join(sorted(names))})",
        )
    return Check("model.lora", PASS, f"targets {', '.join(wanted)} present")


def check_quantization(cfg) -> Check:
    """The quantization the plan assumes, available on a CUDA machine with this install
    (bitsandbytes looked up here: a login node shares the GPU nodes' environment)."""
    from calm_lightning.models.model_node import quantization_available

    model = OmegaConf.to_container(cfg.model, resolve=True)
    ok, reason = quantization_available(model, cuda=True)
    return Check("model.quantization", PASS if ok else FAIL, reason)
