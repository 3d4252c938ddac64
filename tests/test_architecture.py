"""The shape the project promises: one method protocol with no dead config keys, a run that
says what a method_setting file changed, data checked before any model loads, user errors
without tracebacks, and no pointer to documents outside the repository."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import InstantiationException
from hydra.utils import get_class
from omegaconf import OmegaConf

from calm_lightning.errors import DataFormatError
from calm_lightning.methods.base import HEAD_CONFIGURED, CalibrationMethod
from calm_lightning.methods.training import TrainingMethod
from calm_lightning.runtime.method_settings import applied_method_setting

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
METHOD_FILES = sorted((CONF / "method").glob("*.yaml"))
# Passed by the pipeline to every method, never set in a method file.
EVALUATION_ARGS = {"option_tokens", "probe_size", "n_bins", "openqa"}


def accepted_arguments(cls: type) -> set[str]:
    """Constructor arguments a method class takes, following **kwargs up its bases."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or not issubclass(klass, CalibrationMethod):
            continue
        params = inspect.signature(klass.__init__).parameters.values()
        names |= {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD}
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break
    return names - {"self", "model", "tokenizer"}


def _method(path: Path) -> tuple[dict, type]:
    """A method file as Hydra composes it: a file may extend another of its group first
    (`defaults: [daca, _self_]`)."""
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    parents = [d for d in raw.pop("defaults", []) if d != "_self_"]
    merged = OmegaConf.merge(*[_method(path.parent / f"{p}.yaml")[0] for p in parents], raw)
    node = OmegaConf.to_container(merged, resolve=False)
    return node, get_class(node["module"]["_target_"])


BUDGET_EPOCH = "${budget.bilevel_epoch_batches}"


@pytest.mark.parametrize("path", METHOD_FILES, ids=lambda p: p.stem)
def test_method_files_hold_only_keys_the_code_reads(path):
    node, cls = _method(path)
    assert issubclass(cls, CalibrationMethod)
    expected = {"name", "module", "traits"}  # traits: what plan and report read
    expected |= {"epochs"} if issubclass(cls, TrainingMethod) else set()
    # the bilevel methods size their epoch by the budget group (conf/budget/); a training
    # method may too (the pipeline hands method.epoch_batches to the data module for any method:
    # reg_lambda runs CALM's budget), but only as the budget's value
    bilevel = any(k.__name__ in ("CALM", "Iterate") for k in cls.__mro__)  # calm_token too
    budgeted = issubclass(cls, TrainingMethod) and node.get("epoch_batches") == BUDGET_EPOCH
    expected |= {"epoch_batches"} if bilevel or budgeted else set()
    expected |= {"head"} if cls.head == HEAD_CONFIGURED else set()
    assert set(node) == expected, f"{path.name}: keys {sorted(node)}, the class reads {expected}"
    module_keys = set(node["module"]) - {"_target_"}
    unknown = module_keys - accepted_arguments(cls)
    assert not unknown, f"{path.name}: {cls.__name__} takes no {sorted(unknown)}"
    assert not module_keys & EVALUATION_ARGS
    assert node["name"] == path.stem  # method_settings.py relies on it


def test_method_setting_files_set_only_keys_the_code_reads():
    for path in sorted((CONF / "method_setting").glob("*.yaml")):
        # the longest method name that prefixes the file (calm_stop_demo is calm_stop's)
        method = max(
            (m for m in METHOD_FILES if path.stem.startswith(f"{m.stem}_")),
            key=lambda m: len(m.stem),
        )
        setting = path.stem[len(method.stem) + 1 :]
        assert (CONF / "setting" / f"{setting}.yaml").is_file(), path.name
        node, cls = _method(method)
        override = OmegaConf.to_container(OmegaConf.load(path)).get("method", {})
        assert set(override) <= {"module", "epochs", "epoch_batches", "head"}, path.name
        if "epochs" in override:
            assert issubclass(cls, TrainingMethod), path.name
        if "head" in override:  # only a method that tunes a configured head reads it
            assert cls.head == HEAD_CONFIGURED, path.name
            assert set(override["head"]) <= set(node["head"]), path.name
        unknown = set(override.get("module", {})) - accepted_arguments(cls)
        assert not unknown, f"{path.name}: {cls.__name__} takes no {sorted(unknown)}"


def test_an_unknown_module_key_is_refused(compose, tmp_path, tiny_loaded):
    from calm_lightning.evaluation.scorers import scorer_from_config
    from calm_lightning.pipeline import build_method

    cfg = compose(["model=tiny", "method=base", "+method.module.temperature=2"], tmp_path)
    with pytest.raises(InstantiationException, match="unexpected keyword argument 'temperature'"):
        build_method(cfg, tiny_loaded, scorer_from_config(cfg.evaluation))


def test_setting_names_match_their_files():
    for path in sorted((CONF / "setting").glob("*.yaml")):
        assert OmegaConf.load(path).name == path.stem


def test_the_run_says_what_a_method_setting_file_changed(compose, tmp_path):
    cfg = compose(["method=calm", "setting=demo", "method.module.inner_steps=2"], tmp_path)
    applied = applied_method_setting(cfg)
    assert applied["file"] == "conf/method_setting/calm_demo.yaml"
    values = applied["values"]
    # default from conf/method/calm.yaml, the file's value, and the command line winning
    assert values["method.module.inner_steps"] == {"default": 20, "method_setting": 3, "value": 2}
    assert values["method.module.lower_lr"] == {
        "default": 1e-3,
        "method_setting": 1e-4,
        "value": 1e-4,
    }
    assert values["trainer.limit_train_batches"]["default"] is None  # trainer/default.yaml
    assert values["setting.max_length"] == {"default": 256, "method_setting": 192, "value": 192}
    assert applied_method_setting(compose(["method=base", "setting=demo"], tmp_path)) is None


@pytest.mark.integration
def test_a_run_records_the_method_setting_in_metrics_json(compose, tmp_path):
    from calm_lightning.pipeline import run_experiment

    overrides = ["model=tiny", "method=ts", "setting=demo_posthoc"]
    run_experiment(compose(overrides, tmp_path))
    payload = json.loads((tmp_path / "metrics.json").read_text())
    row = payload["method_setting"]["values"]["method.module.calibration_fraction"]
    assert payload["method_setting"]["file"] == "conf/method_setting/ts_demo_posthoc.yaml"
    assert row == {"default": 0.5, "method_setting": 1.0, "value": 1.0}
    assert set(payload["comparison"]) == {"base", "ts"} and "temperature" in payload["posthoc"]


def _malformed_training_overrides(tmp_path: Path) -> list[str]:
    bad = tmp_path / "train.jsonl"
    rows = [
        {"instruction": "Name a colour.", "input": "", "output": "Blue."},
        {"instruction": "Name a fruit.", "input": ""},  # no output
    ]
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        "model=tiny",
        "method=calm",
        "setting=demo",  # instruction training data
        "setting.train._target_=calm_lightning.data.sources.LocalFileSource",
        "~setting.train.split",
        f"+setting.train.files=[{bad}]",
    ]


def test_a_malformed_training_file_fails_before_any_model_loads(compose, tmp_path, monkeypatch):
    import calm_lightning.pipeline as pipeline

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    cfg = compose(_malformed_training_overrides(tmp_path), tmp_path / "run")
    with pytest.raises(DataFormatError, match=r"train\.jsonl.*line 2.*missing field 'output'"):
        pipeline.run_experiment(cfg)


@pytest.mark.integration
def test_user_errors_print_without_a_traceback(tmp_path):
    command = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        *_malformed_training_overrides(tmp_path),
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "missing field 'output'" in done.stderr and "Traceback" not in done.stderr
    full = subprocess.run(
        command, env={**env, "HYDRA_FULL_ERROR": "1"}, capture_output=True, text=True, timeout=300
    )
    assert full.returncode == 1 and "Traceback" in full.stderr


def test_the_pipeline_only_orchestrates():
    source = (ROOT / "calm_lightning" / "pipeline.py").read_text()
    for word in ("wandb", "posthoc", ".trains", "perf_counter", "isinstance(module"):
        assert word not in source, word


def test_nothing_points_outside_the_repository():
    # Built from parts so this file does not match itself.
    patterns = ["../" + "shared", "shared/" + "design", "ALGORITHMS" + ".md", "PLATFORM" + "-FACTS"]
    patterns.append("STYLE" + ".md")
    roots = [
        "calm_lightning", "conf", "docs", "tests", "benchmarks", "studies", "tools",
        "multirun_sweeps",
    ]  # fmt: skip
    files = [p for r in roots for p in (ROOT / r).rglob("*") if p.is_file()]
    files.append(ROOT / "README.md")
    for path in files:
        if path.suffix not in {".py", ".md", ".yaml", ".sh", ".toml", ".txt"}:
            continue
        text = path.read_text(errors="ignore")
        hits = [p for p in patterns if p in text]
        assert not hits, f"{path.relative_to(ROOT)} points outside the repository: {hits}"


def test_calm_refuses_fp16_before_any_model_loads(compose, tmp_path, monkeypatch):
    import calm_lightning.pipeline as pipeline
    from calm_lightning.errors import ConfigError

    monkeypatch.setattr(pipeline, "load_language_model", lambda *_: pytest.fail("model loaded"))
    cfg = compose(["model=tiny", "method=calm", "trainer.precision=16-mixed"], tmp_path)
    with pytest.raises(ConfigError, match="not fp16.*trainer.precision=32-true"):
        pipeline.run_experiment(cfg)


def test_auto_precision_never_picks_fp16(monkeypatch):
    """A GPU without bf16 gets fp32, so the default method (CALM) runs there too."""
    import torch

    from calm_lightning.runtime import resolvers

    monkeypatch.setattr(resolvers, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert resolvers.resolve_precision("auto") == "32-true"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolvers.resolve_precision("auto") == "bf16-mixed"
    monkeypatch.setattr(resolvers, "cuda_available", lambda: False)
    assert resolvers.resolve_precision("auto") == "32-true"
    assert resolvers.resolve_precision("16-mixed") == "16-mixed"
