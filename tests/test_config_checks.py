"""Every config value is checked in one pass before anything heavy (validation.py):
the full key, the bad value and what is allowed, before the config is written, any data is
read, any logger is created or any weights load."""

from __future__ import annotations

import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from calm_lightning.config_rules import (
    Either,
    Flag,
    Keys,
    ListOf,
    Number,
    OneOf,
    Text,
    check_values,
    merged_rules,
)
from calm_lightning.errors import ConfigError

CONF = Path(__file__).resolve().parents[1] / "conf"
DTYPES = "auto, float32, bfloat16, float16"

BAD_VALUES = [
    # the primary config
    ("seed=abc", "seed='abc' must be an integer"),
    # model (models/loading.py) and its evaluation defaults (evaluation/rules.py)
    ("model.dtype=bogus", f"model.dtype='bogus' is not one of {DTYPES}"),
    ("model.source=gguf", "model.source='gguf' is not one of embedded, hub, tiny"),
    ("model.quantization=int3", "model.quantization='int3' is not one of auto, nf4, none"),
    ("model.logit_scale=-1", "model.logit_scale=-1 must be a number > 0"),
    ("model.logit_scale=0", "model.logit_scale=0 must be a number > 0"),
    ("model.tokenizer=spm", "model.tokenizer='spm' is not one of embedded, bytes"),
    ("model.tiny.num_layers=0", "model.tiny.num_layers=0 must be an integer >= 1"),
    (
        "model=olmo2 model.trust_remote_code=maybe",
        "model.trust_remote_code='maybe' must be true or false",
    ),
    ("+model.mcqa_scoring=bogus", "model.mcqa_scoring='bogus' is not one of letter, cloze"),
    (
        "method=daca setting=demo_posthoc reference_model=tiny_plm reference_model.dtype=half",
        f"reference_model.dtype='half' is not one of {DTYPES}",
    ),
    # peft (models/lora.py)
    ("peft.r=0", "peft.r=0 must be an integer >= 1"),
    ("peft.method=dora", "peft.method='dora' is not one of lora, none"),
    ("peft.lora_dropout=1.0", "peft.lora_dropout=1.0 must be a number >= 0 and < 1"),
    ("peft.lora_alpha=0", "peft.lora_alpha=0 must be a number > 0"),
    ("peft.bias=some", "peft.bias='some' is not one of none, all, lora_only"),
    (
        "peft.target_modules=[]",
        "peft.target_modules=[] must be all-linear or a regex over module names; or a list of "
        "module names",
    ),
    # setting (data/setting_rules.py)
    ("setting.batch_size=0", "setting.batch_size=0 must be an integer >= 1"),
    ("setting.eval_batch_size=2.5", "setting.eval_batch_size=2.5 must be an integer >= 1"),
    ("setting.heldout_batch_size=0", "setting.heldout_batch_size=0 must be an integer >= 1"),
    ("setting.max_length=0", "setting.max_length=0 must be an integer >= 1"),
    ("setting.num_workers=-1", "setting.num_workers=-1 must be an integer >= 0"),
    # trainer (runtime/strategies.py)
    ("trainer.max_steps=-2", "trainer.max_steps=-2 must be an integer >= -1"),
    ("trainer.precision=fp8", "trainer.precision='fp8' is not one of transformer-engine, "),
    ("trainer.accelerator=quantum", "trainer.accelerator='quantum' is not one of auto, cpu, gpu"),
    ("trainer.devices=0", "trainer.devices=0 must be one of auto, -1; or an integer >= 1; or"),
    (
        "trainer.limit_train_batches=1.5",
        "trainer.limit_train_batches=1.5 must be an integer >= 0; or a number >= 0 and <= 1",
    ),
    (
        "+trainer.accumulate_grad_batches=0",
        "trainer.accumulate_grad_batches=0 must be an integer >= 1",
    ),
    ("trainer.enable_progress_bar=yes", "trainer.enable_progress_bar='yes' must be true or false"),
    # logger (runtime/loggers.py)
    ("logger.csv.save_dir=null", "logger.csv.save_dir=None must be a non-empty string"),
    (
        "logger=wandb logger.wandb.resume=sometimes",
        "logger.wandb.resume='sometimes' is not one of allow, must, never, auto, True, False",
    ),
    # evaluation (evaluation/rules.py: scorers, open QA, retention)
    ("evaluation.base_cache=maybe", "evaluation.base_cache='maybe' must be true or false"),
    (
        "evaluation.cloze.normalize=bogus",
        "evaluation.cloze.normalize='bogus' is not one of none, tokens, chars",
    ),
    ("evaluation.openqa.containment=1", "evaluation.openqa.containment=1 must be true or false"),
    (
        "evaluation.retention.batch_size=0",
        "evaluation.retention.batch_size=0 must be an integer >= 1",
    ),
    # method: the group's keys, the class's module rules, the head (models/calibrated_lm.py)
    ("method.epochs=0", "method.epochs=0 must be an integer >= 1"),
    ("method.module.inner_steps=0", "method.module.inner_steps=0 must be an integer >= 1"),
    (
        "method.module.surrogate.schedule=bogus",
        "method.module.surrogate.schedule='bogus' is not one of per_step, amortized",
    ),
    ("method.head.kind=wrong", "method.head.kind='wrong' is not one of vector, scalar"),
    ("method=cape method.module.permutations=some", "method.module.permutations='some'"),
    (
        "method=elicitation method.module.fallback_confidence=zero",
        "method.module.fallback_confidence='zero' is not one of uniform, model",
    ),
    ("method=reg method.module.alpha_reg=-1", "method.module.alpha_reg=-1 must be a number >= 0"),
]


@pytest.fixture
def refuse_heavy_work(monkeypatch):
    """Make writing the config, reading data, creating loggers and loading weights fail."""
    import calm_lightning.pipeline as pipeline
    from calm_lightning.data.datamodule import CalibrationDataModule

    for name in ("write_config", "build_loggers", "load_language_model"):
        monkeypatch.setattr(pipeline, name, lambda *_, name=name, **__: pytest.fail(name))
    monkeypatch.setattr(CalibrationDataModule, "load_records", lambda *_: pytest.fail("data"))
    return pipeline


@pytest.mark.parametrize(("overrides", "message"), BAD_VALUES, ids=[o for o, _ in BAD_VALUES])
def test_a_bad_value_stops_before_anything_heavy(
    overrides, message, compose, tmp_path, refuse_heavy_work
):
    cfg = compose(["model=tiny", *overrides.split()], tmp_path)
    with pytest.raises(ConfigError) as error:
        refuse_heavy_work.run_experiment(cfg)
    assert str(error.value).startswith(message)


# What a group's option needs from the other groups to be a run the docs describe.
PAIRED = {"trainer=fsdp": ["method=reg"]}


def shipped_choices() -> list[str]:
    """Every option of every group a run composes, and every method_setting file (as its
    method and setting; the file is picked up by their names)."""
    groups = ("model", "reference_model", "peft", "method", "setting", "trainer", "logger")
    groups += ("callbacks", "clusterer")
    choices = [f"{g}={p.stem}" for g in groups for p in sorted((CONF / g).glob("*.yaml"))]
    methods = sorted((p.stem for p in (CONF / "method").glob("*.yaml")), key=len, reverse=True)
    for path in sorted((CONF / "method_setting").glob("*.yaml")):
        method = next(m for m in methods if path.stem.startswith(f"{m}_"))
        choices.append(f"method={method} setting={path.stem[len(method) + 1 :]}")
    return choices


@pytest.mark.parametrize("choice", shipped_choices())
def test_every_shipped_config_passes_validation(choice, compose, tmp_path):
    from calm_lightning.methods.base import method_class
    from calm_lightning.pipeline import build_sources
    from calm_lightning.validation import validate_config

    # the tiny model and its reference model: every method's requirements can be met
    base = ["model=tiny", "reference_model=tiny_plm", *PAIRED.get(choice, [])]
    cfg = compose([*base, *choice.split()], tmp_path)
    validate_config(cfg, method_class(cfg), build_sources(cfg))


def test_the_shipped_choices_cover_every_group_file():
    choices = " ".join(shipped_choices())
    for path in (CONF / "model").glob("*.yaml"):
        assert f"model={path.stem}" in choices
    assert "method=calm_stop setting=demo_id" in choices  # the longest method name wins


def test_the_loaders_refuse_with_the_rules_the_validation_uses():
    """One rule per key: the loader's refusal is the validation's message, word for word."""
    from torch import nn

    from calm_lightning.models.loading import (
        apply_logit_scale,
        load_language_model,
        resolve_dtype,
        resolve_quantization,
    )
    from calm_lightning.models.lora import wrap_with_lora

    cases = [
        (lambda: resolve_dtype("bogus"), f"model.dtype='bogus' is not one of {DTYPES}"),
        (lambda: resolve_quantization("int3"), "model.quantization='int3' is not one of auto"),
        (lambda: apply_logit_scale(nn.Linear(2, 2), -1), "model.logit_scale=-1 must be"),
        (
            lambda: load_language_model({"source": "gguf"}),
            "model.source='gguf' is not one of embedded, hub, tiny",
        ),
        (lambda: wrap_with_lora(nn.Linear(2, 2), {"r": 0}), "peft.r=0 must be an integer >= 1"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError) as error:
            call()
        assert str(error.value).startswith(message)


def test_trainer_choices_are_lightnings_own():
    """The precision and accelerator names the rules allow are those Lightning accepts."""
    from lightning.fabric.plugins.precision import precision
    from lightning.pytorch.accelerators import AcceleratorRegistry

    from calm_lightning.runtime.strategies import ACCELERATORS, PRECISIONS

    lightning_precisions = {
        value for part in typing.get_args(precision._PRECISION_INPUT) for value in part.__args__
    }
    assert set(PRECISIONS) == lightning_precisions
    assert set(ACCELERATORS) == set(AcceleratorRegistry.available_accelerators()) | {
        "auto",
        "gpu",
    }


def test_peft_bias_choices_are_peft_own():
    from peft import LoraConfig

    from calm_lightning.models.lora import PEFT_RULES

    bias = typing.get_type_hints(LoraConfig)["bias"]
    assert set(PEFT_RULES["bias"].choices) == set(typing.get_args(bias))


BAD_COMMANDS = [
    ("model.dtype=bogus", "model.dtype='bogus'"),
    ("peft.r=0", "peft.r=0"),
    ("setting.batch_size=0", "setting.batch_size=0"),
    ("model.logit_scale=-1", "model.logit_scale=-1"),
]


@pytest.mark.integration
def test_the_command_line_refuses_without_a_traceback_and_writes_nothing(tmp_path):
    """The default model and method (the embedded SmolLM2, CALM): exit 1 with the key, no
    traceback, and no config, logs or model in the run folder."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    for number, (override, message) in enumerate(BAD_COMMANDS):
        run_dir = tmp_path / f"run{number}"
        done = subprocess.run(
            [sys.executable, "-m", "calm_lightning.run", override, f"hydra.run.dir={run_dir}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr[-2000:]
        assert message in done.stderr and "Traceback" not in done.stderr
        left = sorted(p.name for p in run_dir.iterdir())
        # Hydra's own folder and log only: no config_resolved.yaml, csv/, wandb/, base/
        assert set(left) <= {".hydra", "run.log"}, left


def test_fsdp_with_four_bit_weights_is_refused_before_the_model(
    compose, tmp_path, refuse_heavy_work
):
    cfg = compose(["model=tiny", "method=reg", "trainer=fsdp", "model.quantization=nf4"], tmp_path)
    with pytest.raises(ConfigError, match="trainer=fsdp with model.quantization=nf4"):
        refuse_heavy_work.run_experiment(cfg)


def test_rules_name_key_value_and_choices():
    rules = {
        "steps": Number(minimum=1, integer=True),
        "lr": Number(minimum=0, exclusive_minimum=True, optional=True),
        "frac": Number(minimum=0, maximum=1),
        "drop": Number(minimum=0, maximum=1, exclusive_maximum=True),
        "kind": OneOf(("a", "b"), required=True),
        "shape": OneOf(("s",), optional=True),
        "inner": Keys(("x", "y")),
        "inner.x": OneOf((1, 2)),
        "on": Flag(),
        "id": Text(optional=True),
        "code": Text(pattern=r"[a-z]+", meaning="lower-case letters"),
        "ids": ListOf(Number(minimum=0, integer=True), nonempty=True),
        "devices": Either((OneOf(("auto",)), Number(minimum=1, integer=True))),
    }
    ok = {
        **{"steps": 3, "lr": None, "frac": 1, "drop": 0.5, "kind": "a", "shape": None},
        **{"inner": {"x": 2}, "on": False, "id": None, "code": "abc", "ids": [0, 3]},
        "devices": "auto",
    }
    check_values("m", ok, rules)
    check_values("m", {**ok, "devices": 2, "shape": "s", "id": "x"}, rules)
    cases = [
        ({"steps": 2.5}, "m.steps=2.5 must be an integer >= 1"),
        ({"steps": True}, "m.steps=True must be an integer >= 1"),
        ({"lr": 0.0}, "m.lr=0.0 must be a number > 0"),
        ({"frac": 1.5}, "m.frac=1.5 must be a number >= 0 and <= 1"),
        ({"drop": 1}, "m.drop=1 must be a number >= 0 and < 1"),
        ({"kind": "c"}, "m.kind='c' is not one of a, b"),
        ({"shape": "t"}, "m.shape='t' is not one of s"),
        ({"inner": {"z": 1}}, "m.inner={'z': 1} has unknown keys ['z']; allowed: x, y"),
        ({"inner": {"x": 3}}, "m.inner.x=3 is not one of 1, 2"),
        ({"on": 1}, "m.on=1 must be true or false"),
        ({"on": "true"}, "m.on='true' must be true or false"),
        ({"id": ""}, "m.id='' must be a non-empty string"),
        ({"id": 7}, "m.id=7 must be a non-empty string"),
        ({"code": "ABC"}, "m.code='ABC' must be lower-case letters"),
        ({"ids": []}, "m.ids=[] must be a non-empty list, each item an integer >= 0"),
        ({"ids": [0, -1]}, "m.ids=[0, -1] must be a non-empty list, each item an integer >= 0"),
        ({"devices": 0}, "m.devices=0 must be one of auto; or an integer >= 1"),
    ]
    for change, message in cases:
        with pytest.raises(ConfigError) as error:
            check_values("m", {**ok, **change}, rules)
        assert str(error.value) == message
    missing = dict(ok)
    del missing["kind"]
    with pytest.raises(ConfigError, match="m.kind=None is not one of a, b"):
        check_values("m", missing, rules)
    del missing["steps"]  # an optional key left out: its default applies
    with pytest.raises(ConfigError, match="m.kind"):
        check_values("m", missing, rules)


def test_rules_follow_the_class_hierarchy():
    from calm_lightning.methods.calm import CALM
    from calm_lightning.methods.single_level import Regularization

    calm, reg = merged_rules(CALM), merged_rules(Regularization)
    assert {"inner_steps", "surrogate.schedule", "warmup_ratio"} <= set(calm)
    assert {"alpha_reg", "lr", "warmup_ratio"} <= set(reg) and "inner_steps" not in reg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [(["model=tulu", "setting=demo"], "model.quantization=auto on a CUDA GPU without "
      "bitsandbytes: a model of 8.0B parameters runs as the paper's 4-bit QLoRA; install it "
      "(pip install -e '.[quant]' (or pip install bitsandbytes)) or set model.quantization=none "
      "for bf16 LoRA"),
     (["model=llama31_8b_instruct", "reference_model=llama31_8b", "method=daca",
       "setting=demo_posthoc", "reference_model.quantization=auto"],
      "reference_model.quantization=auto on a CUDA GPU without bitsandbytes: a model of 8.0B")],
)  # fmt: skip
def test_auto_quantization_without_bitsandbytes_is_refused_at_the_config_check(
    overrides, message, compose, tmp_path, refuse_heavy_work, monkeypatch
):
    """On a CUDA machine without bitsandbytes, `auto` for a model of 3B parameters or more
    (its count from its shape) stops the run in the config check, in one line, before any data,
    logger or weights; `model.quantization=none` passes the same check (bf16 LoRA)."""
    from calm_lightning.models import loading

    monkeypatch.setattr(loading, "cuda_available", lambda: True)
    monkeypatch.setattr(loading, "_bitsandbytes_installed", lambda: False)
    cfg = compose(overrides, tmp_path)
    with pytest.raises(ConfigError) as error:
        refuse_heavy_work.run_experiment(cfg)
    assert str(error.value).startswith(message) and "\n" not in str(error.value)
    if overrides[0] == "model=tulu":
        from calm_lightning.methods.base import method_class
        from calm_lightning.validation import validate_config

        none = compose([*overrides, "model.quantization=none"], tmp_path)
        validate_config(none, method_class(none), refuse_heavy_work.build_sources(none))
