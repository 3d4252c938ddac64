"""Every shipped config composes, its targets exist, and bad values say what is valid."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, MissingConfigException
from hydra.utils import get_class, instantiate
from omegaconf import OmegaConf

CONF = Path(str(resources.files("calm_lightning.conf")))


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


def _check_composes(compose, model: str, method: str, setting: str, tmp_path, extra=()):
    overrides = [f"model={model}", f"method={method}", f"setting={setting}", *extra]
    cfg = compose(overrides, tmp_path)
    OmegaConf.resolve(cfg)  # every interpolation resolves
    assert cfg.model.name == model and cfg.method.name == method and cfg.setting.name == setting
    assert cfg.model.source in {"embedded", "hub", "tiny"}
    get_class(cfg.method.module._target_)  # the method's LightningModule exists
    return cfg


# Methods and settings interact (optional method_setting files, interpolations), so every pair
# is composed; a model only fills the `model` node, so each is composed once (the full cross
# product grew past a thousand compositions, ~2.5 min, for no extra coverage). The fast loop
# composes the pairs a method_setting file joins (where they interact) plus every method and
# every setting once; the gate (`integration`) composes all ~200 pairs (~30 s).
def _pairs() -> list[tuple[str, str]]:
    methods, settings = options("method"), options("setting")
    joined = {(m, s) for m in methods for s in settings if f"{m}_{s}" in options("method_setting")}
    joined |= {(m, "demo") for m in methods} | {("calm", s) for s in settings}
    return sorted(joined)


@pytest.mark.parametrize(("method", "setting"), _pairs())
def test_each_method_setting_file_and_each_option_composes(method, setting, tmp_path, compose):
    _check_composes(compose, "tiny", method, setting, tmp_path)


@pytest.mark.integration
@pytest.mark.parametrize("method", options("method"))
@pytest.mark.parametrize("setting", options("setting"))
def test_every_method_setting_pair_composes(method, setting, tmp_path, compose):
    _check_composes(compose, "tiny", method, setting, tmp_path)


@pytest.mark.parametrize("model", options("model"))
def test_every_model_composes(model, tmp_path, compose):
    _check_composes(compose, model, "ts", "id", tmp_path)


@pytest.mark.parametrize("reference", options("reference_model"))
def test_every_reference_model_composes(reference, tmp_path, compose):
    cfg = _check_composes(
        compose, "tiny", "dual_align", "demo_posthoc", tmp_path, [f"reference_model={reference}"]
    )
    node = cfg.method.module.reference_model
    if reference == "none":
        assert not node
    else:
        assert node.name == reference and node.source in {"hub", "tiny", "embedded"}
        if node.source != "tiny":  # its PoLM exists as a model config
            assert node.pairs_with in options("model")


@pytest.mark.parametrize("logger", options("logger"))
def test_trainer_and_loggers_instantiate(logger, tmp_path, compose):
    if logger == "wandb":
        pytest.importorskip("wandb")
    cfg = compose(
        [f"logger={logger}", "logger.wandb.offline=true"]
        if logger == "wandb"
        else [f"logger={logger}"],
        tmp_path,
    )
    loggers = [instantiate(node) for node in cfg.logger.values()]
    trainer = instantiate(cfg.trainer, logger=loggers or False)
    assert trainer.max_epochs == cfg.trainer.max_epochs


@pytest.mark.parametrize("setting", options("setting"))
def test_setting_sources_instantiate(setting, tmp_path, monkeypatch, compose):
    """Bundled data loads; hub data (offline here, no cache) fails with its remedies."""
    from calm_lightning.errors import DataUnavailableError

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf-home"))
    cfg = compose([f"setting={setting}"], tmp_path)
    for split in ("train", "heldout", "test"):
        source = instantiate(cfg.setting[split])
        assert source.kind in {"mcqa", "instruction", "openqa"}
        if setting.startswith("demo"):  # bundled with the package
            assert len(source.load()) > 0
        else:
            with pytest.raises(DataUnavailableError, match="pass local files"):
                source.load()


def test_every_config_field_is_commented():
    """Every config field gets a short comment in its YAML (docs/architecture.md, habits)."""
    missing = []
    for path in CONF.rglob("*.yaml"):
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", "-", "_target_", "{}")):
                continue
            key, sep, value = stripped.partition(":")
            if not sep or not value.strip():
                continue  # a section header; its children carry the comments
            if "#" not in value:
                missing.append(f"{path.relative_to(CONF)}:{number}: {stripped}")
    assert not missing, "\n".join(missing)


def test_unknown_group_option_lists_the_valid_choices(tmp_path, compose):
    with pytest.raises(MissingConfigException) as err:
        compose(["model=gpt5"], tmp_path)
    message = str(err.value)
    for valid in options("model"):
        assert valid in message


def test_unknown_key_is_rejected(tmp_path, compose):
    with pytest.raises(ConfigCompositionException, match="evaluation.colour"):
        compose(["evaluation.colour=red"], tmp_path)


@pytest.mark.parametrize("sweep", options("sweep"))
def test_every_sweep_composes_as_a_multirun(sweep, tmp_path, compose):
    from hydra.types import RunMode

    cfg = compose([f"+sweep={sweep}"], tmp_path, hydra=True)
    assert cfg.hydra.mode == RunMode.MULTIRUN
    params = dict(cfg.hydra.sweeper.params)
    assert params and all("," in str(v) for v in params.values())
    first_line = (CONF / "sweep" / f"{sweep}.yaml").read_text().splitlines()[1]
    assert first_line.startswith("# ") and ("?" in first_line or ":" in first_line)


def test_cluster_launcher_and_optuna_sweeper_compose(tmp_path, compose):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper")
    cfg = compose(["hydra/launcher=slurm", "+sweep=optuna_calm"], tmp_path, hydra=True)
    assert "submitit" in cfg.hydra.launcher._target_ and cfg.hydra.launcher.gpus_per_node == 1
    assert "optuna" in cfg.hydra.sweeper._target_.lower()
    assert cfg.hydra.sweeper.direction == "minimize" and cfg.method.name == "calm"


def test_sweep_objective_penalises_lost_accuracy(tmp_path, compose):
    from calm_lightning.run import sweep_objective

    cfg = compose([], tmp_path)
    base = {"base": {"accuracy": 0.5}}
    assert sweep_objective(cfg, {"conf_ece": 0.1, "accuracy": 0.45}, base) == pytest.approx(0.1)
    assert sweep_objective(cfg, {"conf_ece": 0.1, "accuracy": 0.39}, base) == pytest.approx(1.1)
    assert sweep_objective(cfg, {"sem_ece": 0.2, "accuracy": 0.1}, {}) == pytest.approx(0.2)


@pytest.mark.parametrize("setting", ["posthoc_mmlu", "posthoc_medmcqa", "demo_posthoc"])
def test_posthoc_settings_load_both_models_unquantized(setting, tmp_path, compose):
    """The paper compares unquantized models: the post-hoc settings override the model group's
    `quantization: auto` (4-bit on CUDA); the PLM configs are unquantized already; a 4-bit
    PoLM asked for on the command line survives."""
    pair = ["model=llama31_8b_instruct", "reference_model=llama31_8b", f"setting={setting}"]
    for method in ("daca", "dual_align", "base"):
        cfg = compose([*pair, f"method={method}"], tmp_path)
        assert cfg.model.quantization == "none" and cfg.reference_model.quantization == "none"
        assert cfg.model.dtype == "auto"  # bf16 on CUDA, fp32 on CPU
        if method != "base":  # what the method loads and keys its lens cache with
            module = cfg.method.module
            assert module.model_config.quantization == "none"
            assert module.reference_model.quantization == "none"
    chosen = compose([*pair, "method=daca", "model.quantization=nf4"], tmp_path)
    assert (
        chosen.model.quantization == "nf4"
        and chosen.method.module.model_config.quantization == "nf4"
    )
    plm_4bit = compose([*pair, "method=daca", "reference_model.quantization=nf4"], tmp_path)
    assert plm_4bit.method.module.reference_model.quantization == "nf4"
    # Other settings keep the model group's default (the CALM paper trains in QLoRA).
    other = compose(["model=llama31_8b_instruct", "setting=ood"], tmp_path)
    assert other.model.quantization == "auto"
    # Without a reference model the node stays empty, so DACA / Dual-Align still refuse.
    assert not compose([f"setting={setting}", "method=daca"], tmp_path).reference_model


def test_posthoc_reference_sweep_loads_unquantized_and_fits_daca_as_the_paper(tmp_path):
    from hydra import compose, initialize_config_module

    overrides = [
        "+sweep=posthoc_reference",
        "model=qwen25_7b_instruct",
        f"paths.output_dir={tmp_path}",
    ]
    with initialize_config_module("calm_lightning.conf", version_base="1.3"):
        cfg = compose("run", overrides=[*overrides, "setting=posthoc_medmcqa", "method=daca"])
        explicit = compose("run", overrides=[*overrides, "model.quantization=nf4"])
        swept = compose("run", overrides=overrides, return_hydra_config=True)
    assert cfg.model.quantization == "none" and explicit.model.quantization == "nf4"
    assert "daca" in swept.hydra.sweeper.params.method.split(",")
    # method=daca is fitted as the paper's Appendix A.3 (every method: Adam 0.05 / 300 / 128);
    # method=daca_repo keeps DACA's repository settings (0.1 / 400 / 256).
    module = cfg.method.module
    assert (module.lr, module.epochs, module.batch_size) == (0.05, 300, 128)


def test_daca_repo_keeps_dacas_own_fit_settings(tmp_path, compose):
    paper = compose(["method=daca", "setting=demo_posthoc"], tmp_path).method
    repo = compose(["method=daca_repo", "setting=demo_posthoc"], tmp_path).method
    assert repo.name == "daca_repo" and repo.module._target_ == paper.module._target_
    assert (repo.module.lr, repo.module.epochs, repo.module.batch_size) == (0.1, 400, 256)
    assert (paper.module.lr, paper.module.epochs, paper.module.batch_size) == (0.05, 300, 128)
    differ = {k for k in paper.module if paper.module[k] != repo.module[k]}
    assert differ == {"lr", "epochs", "batch_size"}


def test_calm_schedule_and_inner_step_have_one_default(tmp_path, compose):
    """The surrogate schedule and the inner optimizer are set in conf/method/calm.yaml only:
    the class has no default of its own, and every paper sweep and paper setting composes to
    the YAML's value."""
    import inspect

    from calm_lightning.methods.calm import CALM

    signature = inspect.signature(CALM.__init__)  # None: refused (test_calm), never defaulted
    assert signature.parameters["surrogate"].default is None
    assert signature.parameters["inner_optimizer"].default is None
    calm_yaml = OmegaConf.load(CONF / "method" / "calm.yaml").module
    paper = [f"+sweep={s}" for s in options("sweep") if s.startswith("calm")]
    for extra in [*paper, "setting=ood", "setting=id", "setting=gen_ood"]:
        cfg = compose(["method=calm", extra], tmp_path, hydra=extra.startswith("+"))
        module = cfg.method.module
        if extra.startswith("+"):  # nor does any sweep grid vary them
            grid = " ".join(cfg.hydra.sweeper.params)
            assert "surrogate" not in grid and "inner_" not in grid, extra
        assert module.surrogate.schedule == calm_yaml.surrogate.schedule, extra
        assert module.inner_optimizer == calm_yaml.inner_optimizer, extra
        assert module.inner_lr == calm_yaml.inner_lr, extra


@pytest.mark.parametrize("method", options("method"))
def test_every_method_declares_the_traits_plan_and_report_read(method, tmp_path, compose):
    from calm_lightning.method_traits import method_traits

    traits = method_traits(compose([f"method={method}"], tmp_path).method)
    assert traits.training in ("none", "single", "alternating", "bilevel")
    module = compose([f"method={method}"], tmp_path).method.module
    cls = get_class(module._target_)
    from calm_lightning.methods.training import TrainingMethod

    # a method that trains declares it, and one that does not says so
    assert traits.trains == issubclass(cls, TrainingMethod), method


def test_the_traits_name_what_the_code_does(tmp_path, compose):
    """CALM's declared step series are the ones it logs; every method has its own place in
    tables; a method without traits is refused naming its file."""
    from calm_lightning.errors import ConfigError
    from calm_lightning.method_traits import method_traits
    from calm_lightning.methods.calm import STEP_SERIES

    traits = {
        m: method_traits(compose([f"method={m}"], tmp_path).method) for m in options("method")
    }
    for name in ("calm", "calm_stop", "calm_token"):
        assert traits[name].step_series == STEP_SERIES and traits[name].bilevel
    positions = [t.table_position for t in traits.values()]
    assert len(set(positions)) == len(positions)
    with pytest.raises(ConfigError, match=r"conf/method/mine\.yaml"):
        method_traits(OmegaConf.create({"name": "mine"}))
    with pytest.raises(ConfigError, match=r"method\.traits\.training='twice'"):
        method_traits(
            OmegaConf.create({"name": "x", "traits": {**vars(traits["reg"]), "training": "twice"}})
        )
