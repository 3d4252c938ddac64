"""Every config value is checked before data or weights load, with the full key, the bad value
and what is allowed (config_checks.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from calm_lightning.config_rules import Keys, Number, OneOf, check_values, merged_rules
from calm_lightning.errors import ConfigError

BAD_VALUES = [
    ("method.module.inner_steps=0", "method.module.inner_steps=0 must be an integer >= 1"),
    (
        "evaluation.cloze.normalize=bogus",
        "evaluation.cloze.normalize='bogus' is not one of none, tokens, chars",
    ),
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


@pytest.mark.parametrize(("overrides", "message"), BAD_VALUES)
def test_a_bad_value_stops_before_the_data_and_the_model(
    overrides, message, compose, tmp_path, monkeypatch
):
    import calm_lightning.pipeline as pipeline
    from calm_lightning.data.datamodule import CalibrationDataModule

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    monkeypatch.setattr(CalibrationDataModule, "load_records", lambda *_: pytest.fail("data read"))
    cfg = compose(["model=tiny", *overrides.split()], tmp_path)
    with pytest.raises(ConfigError) as error:
        pipeline.run_experiment(cfg)
    assert message in str(error.value)


def test_the_command_line_refuses_within_seconds_without_a_traceback(tmp_path):
    """The documented commands (default model and method): exit 1, key, value and choices."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    for override, message in BAD_VALUES[:3]:
        command = [sys.executable, "-m", "calm_lightning.run", override]
        done = subprocess.run(
            [*command, f"hydra.run.dir={tmp_path / 'run'}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 1, done.stderr[-2000:]
        assert message in done.stderr and "Traceback" not in done.stderr
        # Nothing but the config (and Hydra's log) was written: no model was converted/loaded.
        assert not (tmp_path / "run" / "base").exists()


def test_fsdp_with_four_bit_weights_is_refused_before_the_model(compose, tmp_path, monkeypatch):
    import calm_lightning.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    cfg = compose(["model=tiny", "method=reg", "trainer=fsdp", "model.quantization=nf4"], tmp_path)
    with pytest.raises(ConfigError, match="trainer=fsdp with model.quantization=nf4"):
        pipeline.run_experiment(cfg)


def test_rules_name_key_value_and_choices():
    rules = {
        "steps": Number(minimum=1, integer=True),
        "lr": Number(minimum=0, exclusive_minimum=True, optional=True),
        "frac": Number(minimum=0, maximum=1),
        "kind": OneOf(("a", "b"), required=True),
        "inner": Keys(("x", "y")),
        "inner.x": OneOf((1, 2)),
    }
    ok = {"steps": 3, "lr": None, "frac": 1, "kind": "a", "inner": {"x": 2}}
    check_values("m", ok, rules)
    cases = [
        ({"steps": 2.5}, "m.steps=2.5 must be an integer >= 1"),
        ({"steps": True}, "m.steps=True must be an integer >= 1"),
        ({"lr": 0.0}, "m.lr=0.0 must be a number > 0"),
        ({"frac": 1.5}, "m.frac=1.5 must be a number >= 0 and <= 1"),
        ({"kind": "c"}, "m.kind='c' is not one of a, b"),
        ({"inner": {"z": 1}}, "m.inner={'z': 1} has unknown keys ['z']; allowed: x, y"),
        ({"inner": {"x": 3}}, "m.inner.x=3 is not one of 1, 2"),
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


def test_every_shipped_method_config_passes_its_rules(compose, tmp_path):
    from pathlib import Path

    from omegaconf import OmegaConf

    from calm_lightning.methods.base import method_class
    from calm_lightning.runtime.config_checks import evaluation_rules, head_rules

    conf = Path(__file__).resolve().parents[1] / "conf" / "method"
    methods = sorted(p.stem for p in conf.glob("*.yaml"))
    assert len(methods) >= 10
    for method in methods:
        cfg = compose(["model=tiny", f"method={method}"], tmp_path)
        plain = OmegaConf.to_container(cfg, resolve=True)
        check_values("method.module", plain["method"]["module"], merged_rules(method_class(cfg)))
        check_values("method.head", plain["method"].get("head") or {}, head_rules())
        check_values("evaluation", plain["evaluation"], evaluation_rules())
