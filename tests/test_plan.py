"""`python -m calm_lightning.plan`: the jobs a sweep launches, and their estimated cost."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from calm_lightning import cost_model, plan, plan_costs
from calm_lightning.errors import ConfigError
from calm_lightning.models import shapes
from calm_lightning.models.lora import checkpointing_enabled

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "multirun_sweeps" / "table1_mcqa_ood.sh"
COSTS = ROOT / "benchmarks" / "results" / "calm_step_random_small_cpu.json"


def _grid(name: str, **replace: str) -> set[frozenset]:
    """The jobs of conf/sweep/NAME.yaml by hand: the product of its comma lists (a command-line
    list replaces the grid's list of the same key)."""
    params = dict(OmegaConf.load(ROOT / "conf" / "sweep" / f"{name}.yaml").hydra.sweeper.params)
    params.update(replace)
    axes = [[(key, _value(v)) for v in str(values).split(",")] for key, values in params.items()]
    return {frozenset(combo) for combo in itertools.product(*axes)}


def _value(text: str):
    try:
        return float(text)
    except ValueError:
        return text


def _swept(job: plan.Job, keys) -> frozenset:
    pairs = dict(o.split("=", 1) for o in job.overrides)
    return frozenset((k, _value(pairs[k])) for k in keys)


@pytest.fixture(scope="module")
def table1():
    return plan.plan(str(SCRIPT), ["model=tiny"], "a100_40g")


@pytest.fixture(scope="module")
def olmo2_plan(tmp_path_factory):
    """The issue's command: Table 1 for OLMo-2-7B on an A100 40G, no cost file."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert plan.main([str(SCRIPT), "model=olmo2", "--device", "a100_40g", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_table1_lists_the_jobs_hydra_expands_from_the_script_grids(table1):
    jobs = table1
    expected = {
        "calm_ood": _grid("calm_ood"),
        "reg": _grid("reg"),
        "iterate": _grid("iterate"),
        "methods": _grid("methods", method="base,ts,cft"),  # the script's method=base,ts,cft
    }
    assert len(jobs) == sum(len(v) for v in expected.values()) == 27
    for grid, combos in expected.items():
        mine = [j for j in jobs if f"+sweep={grid}" in j.overrides]
        keys = {k for combo in combos for k, _ in combo}
        assert {_swept(j, keys) for j in mine} == combos and len(mine) == len(combos), grid
    for job in jobs:
        assert {"model=tiny", "setting=ood"} <= set(job.overrides)
    assert [j.method for j in jobs[-3:]] == ["base", "ts", "cft"]


def test_a_reg_job_costs_its_steps_times_the_flops_of_one_pass():
    (reg, *_) = plan.plan("+sweep=reg", ["model=olmo2", "setting=ood"], "a100_40g")
    job = {"steps": reg.train_steps, **reg.estimate}
    alpaca = OmegaConf.load(ROOT / "conf" / "data" / "alpaca.yaml")
    epochs = OmegaConf.load(ROOT / "conf" / "method_setting" / "reg_ood.yaml").method.epochs
    setting = OmegaConf.load(ROOT / "conf" / "setting" / "ood.yaml")
    steps = math.ceil(alpaca.train_size / setting.batch_size) * epochs
    assert job["steps"] == steps  # 48,002 rows / 16 x 30 epochs (the paper's OOD reg)
    # By hand, OLMo-2-7B (4096 wide, 32 layers, MLP 11008, vocabulary 100,352): 7,298,617,344
    # parameters less the 100,352 x 4096 input embedding; LoRA r = 64 on q, k, v, o (4096 ->
    # 4096), gate, up (4096 -> 11008) and down. 7.3B parameters turn `auto` checkpointing on,
    # so a frozen-base LoRA pass is two forwards (2 N + 2 P + attention each) and a backward
    # (2 N + 4 P + twice the attention): 6 N + 8 P + 4 x 2 x 32 x w x 4096 per token, at the
    # measured mean width w of 16 Alpaca rows (239.7 tokens); nf4 at 35 % of 312 TFLOP/s.
    n = 7_298_617_344 - 100_352 * 4096
    lora = 32 * 64 * (4 * (4096 + 4096) + 2 * (4096 + 11008) + (11008 + 4096))
    width = 239.7
    per_token = 6 * n + 8 * lora + 4 * 2 * 32 * width * 4096
    seconds = 16 * width * per_token / (312e12 * 0.35)
    assert job["step_s"] == pytest.approx(seconds, rel=1e-9)
    assert 0.3 < job["step_s"] < 3  # the issue's physics: 0.4-1.3 s at 256 tokens


@pytest.mark.integration  # runs the sweep script (a bash subprocess) and composes 27 configs
def test_table1_for_olmo2_on_an_a100_has_the_issues_orders_of_magnitude(olmo2_plan):
    jobs = olmo2_plan["jobs"]
    assert len(jobs) == 27 and olmo2_plan["device"] == "a100_40g"
    for job in jobs:
        assert {"method", "overrides", "steps", "gpu_hours", "peak_gib"} <= set(job)
    reg = next(j for j in jobs if j["method"] == "reg")
    calm = [j for j in jobs if j["method"] == "calm"]
    assert len(calm) == 12
    for job in calm:  # T = 20 passes + a forward + the entropy pass: ~21.5 reg steps
        assert 10 < job["step_s"] / reg["step_s"] < 30
    assert olmo2_plan["total_gpu_hours"] == pytest.approx(sum(j["gpu_hours"] for j in jobs))
    longest = max(j["gpu_hours"] for j in jobs)  # a CALM job: far over the launcher's 12 h
    assert olmo2_plan["slurm_timeout_min"] == math.ceil(longest * 60 * 1.25) > 720


def test_calm_peak_fits_an_a100_with_auto_checkpointing_and_not_without():
    """At 16 x 512 tokens (the widest batch of an epoch) a 7B LoRA step without gradient
    checkpointing keeps ~70 GB of activations; `auto` turns it on from 3B parameters, and
    CALM's peak is then of the paper's order (38 GB)."""
    overrides = ["+sweep=calm_ood", "model=olmo2", "setting=ood"]
    (auto, *_) = plan.plan(overrides[0], overrides[1:], "a100_40g")
    assert auto.method == "calm" and auto.checkpointing
    assert auto.estimate["fits"] and 10 < auto.estimate["peak_gib"] < 60
    (off, *_) = plan.plan(overrides[0], [*overrides[1:], "peft.gradient_checkpointing=false"],
                          "a100_40g")  # fmt: skip
    assert not off.checkpointing and not off.estimate["fits"]
    assert off.estimate["checkpointed_peak_gib"] == pytest.approx(auto.estimate["peak_gib"])
    # the recomputed forward: 6 N instead of 4 N per token, about 1.5x the time
    assert 1.4 < auto.estimate["step_s"] / off.estimate["step_s"] < 1.6
    # an H200 holds the unchecked peak, so the plan says what turning it off buys
    (h200, *_) = plan.plan(overrides[0], overrides[1:], "h200")
    unchecked = h200.estimate["uncheckpointed"]
    assert unchecked["peak_gib"] == pytest.approx(off.estimate["peak_gib"])
    assert unchecked["peak_gib"] < 141
    assert 1.4 < h200.estimate["step_s"] / unchecked["step_s"] < 1.6
    assert "uncheckpointed" not in auto.estimate  # 93 GiB does not fit an A100 40G


def test_auto_checkpointing_follows_the_parameter_count():
    assert not checkpointing_enabled("auto", 2_999_999_999)
    assert checkpointing_enabled("auto", 3_000_000_000)
    assert checkpointing_enabled(True, 10) and not checkpointing_enabled(False, 10**10)
    (small, *_) = plan.plan("+sweep=reg", ["model=smollm2", "setting=ood"], "a100_40g")
    assert not small.checkpointing  # 135M parameters


def test_training_batches_are_priced_at_their_padded_width():
    """Alpaca batches at the measured mean longest row (results/padded_width_alpaca.json);
    other training data at max_length, and never above it."""
    measured = json.loads((ROOT / "results" / "padded_width_alpaca.json").read_text())
    for size, entry in measured["padded_width"].items():
        assert plan_costs.EXPECTED_WIDTH["AlpacaSource"][int(size)] == entry["mean"]
    job = SimpleNamespace(train_source="AlpacaSource", max_length=512)
    assert plan_costs.batch_width(job, 16)[0] == measured["padded_width"]["16"]["mean"]
    assert plan_costs.batch_width(SimpleNamespace(train_source="AlpacaSource", max_length=128),
                                  16)[0] == 128  # fmt: skip
    assert plan_costs.batch_width(SimpleNamespace(train_source="McqaSource", max_length=512),
                                  16) == (512.0, "max_length (upper bound)")  # fmt: skip


def test_the_command_prints_one_estimate_per_job_and_a_total(capsys):
    assert plan.main(["+sweep=calm_ood", "model=olmo2", "--device", "h200"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n#") == 12 and out.count(" GPU-h (train ") == 12
    assert "paper Table 10" in out and "total:" in out and "GPU-hours on h200" in out


def test_a_cost_file_with_phases_out_of_order_is_refused_naming_them(capsys):
    costs = json.loads(COSTS.read_text())  # measured on a loaded CPU: plain 7.4 s > reg 5.7 s
    with pytest.raises(ConfigError, match=r"plain \(7.41 s\) is slower than reg \(5.73 s\)"):
        cost_model.check_order(costs)
    assert plan.main(["+sweep=calm_ood", "model=olmo2", "--costs", str(COSTS)]) == 1
    err = capsys.readouterr().err
    assert "plain" in err and "amortized (1.94 s) is faster than reg" in err


def _gpu_costs(share: float) -> dict:
    """A cost file as benchmarks/calm_step.py writes it on an H100, whose reg step took the
    time the model's FLOPs need at `share` of the peak."""
    shape = shapes.SHAPES["olmo2_7b"]
    lora = cost_model.lora_parameters(shape, 64)
    flops = 4 * 256 * cost_model.training_pass_flops(shape, 256, lora, False)
    reg_s = flops / (989e12 * share)
    step = {"peak_mb": 1, "loaded_mb": 1, "trainable": lora}
    return {
        "device": "cuda (NVIDIA H100 80GB HBM3)", "batch": 4, "seq": 256,
        "model": {"name": "random", "shape": "olmo2_7b", "source": "tiny"},
        "steps": {
            "plain": {**step, "step_s": 0.9 * reg_s}, "reg": {**step, "step_s": reg_s},
            "per_step": {**step, "step_s": 20 * reg_s, "inner_steps": 20},
        },
    }  # fmt: skip


def test_a_gpu_cost_file_replaces_the_assumed_utilisation_with_the_measured_one():
    measured = cost_model.calibrate(_gpu_costs(0.5))
    assert measured["device"] == "h100" and measured["train"] == pytest.approx(0.5)
    (assumed, *_) = plan.plan("+sweep=reg", ["model=olmo2", "setting=ood"], "a100_40g")
    (calibrated, *_) = plan.plan(
        "+sweep=reg", ["model=olmo2", "setting=ood"], "a100_40g", _gpu_costs(0.5)
    )
    ratio = assumed.estimate["step_s"] / calibrated.estimate["step_s"]
    assert ratio == pytest.approx(0.5 / cost_model.UTILISATION["nf4"])


def test_a_cpu_cost_file_in_order_is_refused_for_a_gpu_plan():
    costs = _gpu_costs(0.5)
    costs["device"] = "cpu ()"
    with pytest.raises(ConfigError, match="not on a GPU"):
        cost_model.calibrate(costs)


@pytest.mark.parametrize("group", ["model", "reference_model"])
def test_every_configured_model_has_a_shape(group):
    for path in sorted((ROOT / "conf" / group).glob("*.yaml")):
        node = OmegaConf.to_container(OmegaConf.load(path))
        if node.get("name") in (None, "none"):
            continue
        assert cost_model.model_shape(node) is not None, path.name


def test_a_script_that_refuses_its_arguments_is_a_clear_error(capsys):
    assert plan.main([str(SCRIPT), "model=tiny", "nonsense"]) == 1
    assert "not an option or a key=value override: nonsense" in capsys.readouterr().err


def test_a_gpu_cost_file_prints_its_calm_step_against_the_pass_count(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(_gpu_costs(0.4)))
    assert plan.main(["+sweep=reg", "model=olmo2", "--costs", str(costs), "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "training 40%" in out
    # T = 20 passes + the entropy pass + one forward (2N of a 4N pass, a little more with LoRA)
    (line,) = [x for x in out.splitlines() if x.strip().startswith("per_step:")]
    model = float(line.split(", ")[1].split()[0])
    assert "20.0 reg steps measured" in line and 21.4 < model < 21.6


@pytest.mark.parametrize(
    ("name", "gib", "device"),
    [("NVIDIA H200", 140, "h200"), ("NVIDIA A100-SXM4-80GB", 80, "a100_80g"),
     ("NVIDIA A100-SXM4-40GB", 40, "a100_40g"), ("NVIDIA H100 80GB HBM3", 80, "h100"),
     ("NVIDIA L4", 22, "a100_40g")],
)  # fmt: skip
def test_the_default_device_is_the_local_gpu_else_the_papers_a100(monkeypatch, name, gib, device):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    props = type("Props", (), {"total_memory": gib * 2**30})()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: props)
    assert cost_model.default_device() == device
