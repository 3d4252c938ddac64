"""`python -m calm_lightning.plan`: the jobs a sweep launches, and their estimated cost."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from calm_lightning import plan
from calm_lightning.errors import ConfigError
from calm_lightning.models import shapes
from calm_lightning.models.lora import checkpointing_enabled
from calm_lightning.planning import cost_model, passes
from calm_lightning.planning import jobs as planned_jobs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "multirun_sweeps" / "table1_mcqa_ood.sh"
COSTS = ROOT / "results" / "calm_step_random_small_cpu.json"


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
        "reg_lambda": _grid("reg_lambda"),  # the two control rows (multirun_sweeps/README.md)
        "calm_frozen": _grid("calm_frozen"),
        "iterate": _grid("iterate"),
        "methods": _grid("methods", method="base,ts,cft"),  # the script's method=base,ts,cft
    }
    assert len(jobs) == sum(len(v) for v in expected.values()) == 39
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
    steps = alpaca.train_size // setting.batch_size * epochs  # the sampler drops a partial batch
    assert job["steps"] == steps == 90_000  # 48,002 rows / 16 x 30 epochs (the paper's OOD reg)
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
    assert len(jobs) == 39 and olmo2_plan["device"] == "a100_40g"  # 27 + 12 control jobs
    for job in jobs:
        assert {"method", "overrides", "steps", "gpu_hours", "peak_gib"} <= set(job)
    reg = next(j for j in jobs if j["method"] == "reg")
    calm = [j for j in jobs if j["method"] == "calm"]
    assert len(calm) == 12
    for job in calm:  # T = 20 passes + a forward + the entropy pass: ~21.5 reg steps
        assert 10 < job["step_s"] / reg["step_s"] < 30
    assert olmo2_plan["total_gpu_hours"] == pytest.approx(sum(j["gpu_hours"] for j in jobs))
    longest = max(j["gpu_hours"] for j in jobs)  # a reg job (30 epochs): over the launcher's 12 h
    assert olmo2_plan["slurm_timeout_min"] == math.ceil(longest * 60 * 1.25) > 720
    assert olmo2_plan["slurm_limit_min"] == 720  # conf/hydra/launcher/slurm.yaml
    assert olmo2_plan["max_num_timeout"] == math.ceil(olmo2_plan["slurm_timeout_min"] / 720)
    # budget=paper (the default): 100 outer steps per CALM job, the whole table under 400 GPU-h;
    # every batch (budget=full) is the 15,000-step CALM jobs, ten times as much
    assert olmo2_plan["budget"] == ["paper"] and all(j["steps"] == 100 for j in calm)
    assert 100 < olmo2_plan["total_gpu_hours"] < 400
    assert olmo2_plan["other_budgets_gpu_hours"]["full"] > 8 * olmo2_plan["total_gpu_hours"]


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
    assert unchecked["peak_gib"] < cost_model.DEVICES["h200"].usable_gib
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
        assert passes.EXPECTED_WIDTH["AlpacaSource"][int(size)] == entry["mean"]
    job = SimpleNamespace(train_source="AlpacaSource", max_length=512)
    assert passes.batch_width(job, 16)[0] == measured["padded_width"]["16"]["mean"]
    assert passes.batch_width(SimpleNamespace(train_source="AlpacaSource", max_length=128),
                                  16)[0] == 128  # fmt: skip
    assert passes.batch_width(SimpleNamespace(train_source="McqaSource", max_length=512),
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
    """The local GPU as nvidia-smi lists it (the plan never imports torch)."""
    asked = []

    def smi(command, **kwargs):
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, stdout=f"{name}, {gib * 1024}\n")

    monkeypatch.setattr(cost_model.subprocess, "run", smi)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert cost_model.default_device() == device
    assert asked[0][0] == "nvidia-smi" and asked[0][-2:] == ["--id", "3"]


def test_without_nvidia_smi_the_default_device_is_the_papers_a100(monkeypatch):
    def missing(command, **kwargs):
        raise FileNotFoundError(command[0])

    monkeypatch.setattr(cost_model.subprocess, "run", missing)
    assert cost_model.default_device() == "a100_40g"


# ----- budgets: the epoch of the bilevel methods (conf/budget, docs/calm.md) -----


def _grid_plan(grid: str, *extra: str) -> list[plan.Job]:
    return plan.plan(f"+sweep={grid}", ["model=olmo2", "setting=id", *extra], "a100_40g")


@pytest.mark.parametrize(("grid", "method"), [("calm_id", "calm"), ("reg", "reg"),
                                              ("iterate", "iterate")])  # fmt: skip
def test_the_paper_budget_lands_within_2x_of_table10_in_domain(grid, method):
    """Table 10 (OLMo-2-class 7B on an A100 40G, in-domain, 5 epochs): CALM ~2 h, Reg ~35 min,
    Iterate ~5 min. budget=paper (the default) prices a bilevel epoch at 20 batches: 100 outer
    steps for CALM and Iterate; reg runs its 5 x 125 batches either way."""
    (job, *_) = _grid_plan(grid)
    assert job.method == method and job.budget == "paper"
    assert job.train_steps == (625 if method == "reg" else 100)
    paper_s = cost_model.PAPER_TABLE10[method][1]
    assert 0.5 < job.estimate["train_s"] / paper_s < 2
    assert "this job: " in passes.paper_comparison(job, job.estimate)


def test_the_full_budget_runs_every_batch_and_misses_table10_for_calm():
    (full, *_) = _grid_plan("calm_id", "budget=full")
    (paper, *_) = _grid_plan("calm_id", "budget=paper")
    assert full.budget == "full" and full.epoch_batches == 125 and full.train_steps == 625
    assert full.estimate["step_s"] == pytest.approx(paper.estimate["step_s"])
    assert full.estimate["train_s"] / cost_model.PAPER_TABLE10["calm"][1] > 5  # ~12 h
    assert "budget: full (every method's epoch is every batch)" in plan.budget_line([full])
    assert "budget: paper (bilevel epochs of 20 batches" in plan.budget_line([paper])


@pytest.mark.parametrize(
    ("rows", "batch", "epoch_batches", "limit", "expected"),
    [(2000, 16, None, None, 125), (2000, 16, 20, None, 20), (2000, 16, 20, 12, 12),
     (2000, 16, None, 0.5, 62), (2000, 16, 20, 0.5, 10), (48_002, 16, None, None, 3000),
     (100, 16, 20, None, 6), (None, 16, 20, None, 20), (None, 16, None, None, 0),
     (2000, 16, None, 1.0, 125)],
)  # fmt: skip
def test_an_epoch_is_what_the_sampler_and_the_trainer_let_through(
    rows, batch, epoch_batches, limit, expected
):
    """rows // batch (the last partial batch dropped), then the budget's epoch, then
    trainer.limit_train_batches as a count or a fraction of that."""
    assert planned_jobs.batches_per_epoch(rows, batch, epoch_batches, limit) == expected


def test_a_trainer_limit_or_the_methods_own_epoch_size_wins_over_the_budget():
    """The demo method settings keep their trainer.limit_train_batches and set
    method.epoch_batches=null; both are read from the composed config."""
    (job, *_) = _grid_plan("calm_id", "trainer.limit_train_batches=7")
    assert job.epoch_batches == 7 and job.train_steps == 35
    (job, *_) = _grid_plan("calm_id", "method.epoch_batches=null")
    assert job.epoch_batches == 125  # every batch, whatever the budget


def test_the_base_model_is_charged_once_per_base_cache_entry_of_a_sweep():
    """evaluation.base_cache (the default) scores the untouched model once per sweep folder
    and key (evaluation/base_cache.py): the grid's first job pays for it, the others read it.
    (Without the held-out pass after calibration, which every job pays alike.)"""
    jobs = _grid_plan("calm_id", "evaluation.heldout_metrics=false")
    assert [j.base_read_from for j in jobs] == [None, 0, 0, 0, 0, 0]
    first, later = jobs[0].estimate["eval_s"], jobs[1].estimate["eval_s"]
    assert first == pytest.approx(2 * later)  # base + method, against the method alone
    off = _grid_plan("calm_id", "evaluation.base_cache=false", "evaluation.heldout_metrics=false")
    assert all(j.base_read_from is None for j in off)
    assert all(j.estimate["eval_s"] == pytest.approx(first) for j in off)
    # a head that differs is another entry (the fingerprint holds the head)
    (vector, scalar) = plan.plan("+sweep=calm_id", ["model=olmo2", "setting=id",
                                 "method.head.kind=vector,scalar",
                                 "method.module.lower_lr=1e-3", "method.module.upper_lr=1e-5"],
                                 "a100_40g")  # fmt: skip
    assert vector.base_read_from is None and scalar.base_read_from is None


def test_the_plan_prints_its_budget_the_other_budgets_total_and_both_slurm_settings(
    tmp_path, capsys
):
    out_json = tmp_path / "plan.json"
    args = ["+sweep=calm_id", "model=olmo2", "setting=id", "--device", "a100_40g"]
    assert plan.main([*args, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    record = json.loads(out_json.read_text())
    assert "budget: paper (bilevel epochs of 20 batches" in out
    full = record["other_budgets_gpu_hours"]["full"]
    assert f"with budget=full: {full:.1f} GPU-hours" in out
    assert full > 5 * record["total_gpu_hours"]
    assert "base model: scored by 1 of 6 training jobs" in out
    assert record["base_model_scored_by"] == 1
    timeout, requeues = record["slurm_timeout_min"], record["max_num_timeout"]
    assert requeues == math.ceil(timeout / 720) == 1  # a ~2 h CALM job fits the 12 h limit
    assert f"hydra.launcher.timeout_min={timeout}" in out
    assert f"hydra.launcher.max_num_timeout={requeues}" in out
    # a job longer than the limit: as many requeues as it takes limits (the margin included)
    jobs = [plan.Job(overrides=["hydra.launcher.timeout_min=60"], method="calm", model="x")]
    assert plan.slurm_suggestion(2.0, jobs) == {"timeout_min": 150, "limit_min": 60,
                                                "max_num_timeout": 3}  # fmt: skip
    assert plan.slurm_suggestion(10.0, [])["max_num_timeout"] == math.ceil(750 / 720) == 2


def test_an_unknown_budget_is_refused_in_one_line_naming_the_allowed_ones(capsys):
    assert plan.main(["+sweep=reg", "model=olmo2", "budget=nonsense"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == (
        "error: budget=nonsense: conf/budget/ has no option 'nonsense'; choose one of full, paper"
    )
    assert plan.main([str(SCRIPT), "model=olmo2", "budget=nonsense"]) == 1
    assert "choose one of full, paper" in capsys.readouterr().err


@pytest.mark.integration  # subprocesses
def test_a_whole_plan_and_its_help_never_import_torch():
    """`plan --help` and a whole plan (a sweep script, every job composed twice, the default
    device asked of nvidia-smi) in a fresh interpreter: torch stays out of sys.modules."""
    code = textwrap.dedent(f"""
        import contextlib, io, sys
        from calm_lightning import plan
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                plan.main(["--help"])
            except SystemExit:
                pass
            assert plan.main([{str(SCRIPT)!r}, "model=olmo2"]) == 0
        heavy = ("torch", "lightning", "transformers", "peft")
        print(sorted(m for m in heavy if m in sys.modules))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


def test_a_method_is_priced_by_what_it_declares_not_by_its_name():
    """calm_token is bilevel (its traits, inherited from calm): the plan prices its outer steps
    as CALM's under the same surrogate schedule (calm_stop's amortized one: 1 + m passes and
    the entropy pass), never as one pass (0.04 h against calm's 0.89 h before traits)."""
    ood = ["model=olmo2", "setting=ood"]
    (token, *_) = plan.plan("method=calm_token", ood, "a100_40g")
    (calm, *_) = plan.plan(
        "method=calm", [*ood, "method.module.surrogate.schedule=amortized"], "a100_40g"
    )
    (reg, *_) = plan.plan("method=reg", ood, "a100_40g")
    assert token.traits.bilevel and calm.traits.bilevel and not reg.traits.bilevel
    assert token.schedule == calm.schedule == "amortized"
    assert token.estimate["step_s"] == pytest.approx(calm.estimate["step_s"], rel=1e-9)
    # two lower-level passes and a held-out pass: three reg-sized passes per outer step
    assert token.estimate["step_s"] == pytest.approx(3 * reg.estimate["step_s"], rel=0.05)


def test_the_control_rows_are_priced_with_their_held_out_pass_and_calms_budget():
    """reg_lambda's entropy reads a held-out batch: one more pass of the same width per step
    (Alpaca's held-out rows are Alpaca rows), over CALM's 5 x 20 steps under budget=paper;
    calm_frozen is CALM step for step (a frozen head saves nothing of the passes)."""
    ood = ["model=olmo2", "setting=ood"]
    (control, *_) = plan.plan("method=reg_lambda", ood, "a100_40g")
    (reg, *_) = plan.plan("method=reg", [*ood, "method.epochs=5"], "a100_40g")
    (calm, *_) = plan.plan("method=calm", ood, "a100_40g")
    (frozen, *_) = plan.plan("method=calm_frozen", ood, "a100_40g")
    assert passes.step_passes(control) == (1, 1, 0) and passes.step_passes(reg) == (1, 0, 0)
    assert control.estimate["step_s"] == pytest.approx(2 * reg.estimate["step_s"], rel=1e-6)
    assert control.train_steps == calm.train_steps == 5 * 20
    assert frozen.estimate["step_s"] == pytest.approx(calm.estimate["step_s"], rel=1e-9)


def test_the_held_out_pass_after_calibration_is_charged_to_evaluation():
    """evaluation.heldout_metrics scores the held-out split once more after calibration: its
    rows at their own width (ID: MCQA prompts at eval_max_length; OOD: instructions at
    max_length), one forward each."""
    for setting in ("id", "ood"):
        common = ["model=olmo2", f"setting={setting}", "method=base"]
        (on, *_) = plan.plan("evaluation.heldout_metrics=true", common, "a100_40g")
        (off, *_) = plan.plan("evaluation.heldout_metrics=false", common, "a100_40g")
        assert on.heldout_scored and not off.heldout_scored and on.mcqa_heldout == (setting == "id")
        width = on.eval_max_length if setting == "id" else on.max_length
        fwd = cost_model.forward_flops(
            on.shape, width, cost_model.lora_parameters(on.shape, on.lora_r)
        )
        share = cost_model.utilisation(on.quantized, None)
        extra = cost_model.seconds(
            on.heldout_rows * width * fwd, cost_model.get_device("a100_40g"), share
        )
        assert on.heldout_rows > 0
        assert on.estimate["gpu_hours"] - off.estimate["gpu_hours"] == pytest.approx(
            extra / 3600, rel=1e-6
        )


# ----- capacities, kept logits, quantization, revisions and SLURM limits per job -----


def test_capacities_are_what_cuda_reports_not_the_marketing_gb():
    """usable_gib is torch's total_memory in GiB, from the readings cited in cost_model.py;
    the figure on the box (memory_gb, as the label says it) is kept beside it, and is more."""
    expected = {
        "a100_40g": (40, 42_298_834_944 / 2**30),  # deviceQuery: 42298834944 bytes
        "a100_80g": (80, 79.15),  # torch's OOM message: "total capacity of 79.15 GiB"
        "h100": (80, 81_082 / 1024),  # torch: total_memory=81082MB (MiB)
        "h200": (141, 143_156 / 1024),  # torch: total_memory=143156MB (MiB)
    }
    for name, (sold, usable) in expected.items():
        device = cost_model.DEVICES[name]
        assert device.memory_gb == sold and device.usable_gib == pytest.approx(usable, abs=0.005)
        assert cost_model.usable_gib(name) == device.usable_gib < sold  # what fits is judged by


def _dual_align_pair(*extra: str) -> plan.Job:
    (job,) = plan.plan("method=daca", ["model=llama31_8b_instruct", "reference_model=llama31_8b",
                                       "setting=posthoc_mmlu", *extra], "a100_40g")  # fmt: skip
    return job


def test_evaluation_charges_the_logits_of_the_kept_last_position_only():
    """Letter scoring and the logit lens keep the last position (logits_to_keep=1): per row
    10 bytes per vocabulary entry (bf16 logits, their fp32 copy, the softmax), not 4 bytes at
    every one of the 1,024 positions. By hand, the Llama-3.1-8B pair in bf16 (8,030,261,248
    parameters each), 16 prompts of 1,024 tokens, 4096 wide, MLP 14,336, vocabulary 128,256."""
    job = _dual_align_pair()
    assert job.eval_kept_positions == 1 and not job.quantized and job.eval_batch == 16
    weights = 2 * 2 * 8_030_261_248
    transient = 16 * 1024 * (8 * 4096 + 2 * 14336)
    logits = 16 * 10 * 128_256
    assert job.estimate["peak_gib"] == pytest.approx(
        (weights + transient + logits + 2**30) / 2**30, rel=1e-12
    )
    assert job.estimate["fits"]  # 31.9 GiB; the every-position charge put it at 39.7


def test_a_peak_under_the_40_gb_on_the_box_but_over_what_cuda_reports_does_not_fit():
    """145 prompts a batch put the pair at 39.58 GiB: under 40, over the A100's 39.39."""
    job = _dual_align_pair("setting.eval_batch_size=145")
    by_hand = 2 * 2 * 8_030_261_248 + 145 * 1024 * (8 * 4096 + 2 * 14336) + 145 * 10 * 128_256
    peak = (by_hand + 2**30) / 2**30
    assert job.estimate["peak_gib"] == pytest.approx(peak, rel=1e-12)
    assert 39.39 < peak < 40 and not job.estimate["fits"]


def test_training_charges_full_width_bf16_logits_and_fp32_rows_the_objective_reads():
    """Instruction data (ood: Alpaca) read every response position, bounded by all 16 x 512:
    12 bytes each (fp32 copy, log-softmax, gradient). MCQA data (id) read the answer's few rows
    (8 per example), so what dominates is the full-width bf16 logits' backward (2 x 2 bytes per
    position) beside the rows' fp32 copy. OLMo-2 (vocabulary 100,352), same batch and length:
    the peaks differ by exactly that, all else equal."""
    (ood, *_) = plan.plan("+sweep=reg", ["model=olmo2", "setting=ood"], "a100_40g")
    (mcqa, *_) = plan.plan("+sweep=reg", ["model=olmo2", "setting=id"], "a100_40g")
    assert not ood.mcqa_training and mcqa.mcqa_training
    tokens, rows, vocab = 16 * 512, 16 * 8, 100_352
    instruction = 12 * tokens * vocab
    letter = max(12 * rows, 4 * tokens + 4 * rows) * vocab
    difference = ood.estimate["peak_gib"] - mcqa.estimate["peak_gib"]
    assert difference == pytest.approx((instruction - letter) / 2**30, rel=1e-9)


def test_the_plan_prints_the_quantization_it_assumed_and_unpinned_revisions(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    assert plan.main(["+sweep=reg", "model=tulu", "setting=ood", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert (
        "quantization assumed: tulu nf4: model.quantization=auto on a CUDA GPU with "
        "bitsandbytes; without it a model this size is refused" in out
    )
    assert "WARN model=tulu (allenai/Llama-3.1-Tulu-3-8B-DPO): no revision pinned" in out
    assert out.count("), nf4, peak ") == 4  # each job's line says what it was priced as
    record = json.loads(out_json.read_text())
    for job in record["jobs"]:
        assert job["quantization"] == "nf4" and "bitsandbytes" in job["quantization_reason"]
        assert job["revision_warnings"] and "conf/model/tulu.yaml" in job["revision_warnings"][0]
    assert plan.main(["+sweep=reg", "model=tulu", "setting=ood", "model.quantization=none"]) == 0
    out = capsys.readouterr().out
    assert "quantization assumed: tulu bf16: model.quantization=none" in out


def test_tulus_reg_jobs_need_five_requeues_under_the_720_minute_limit():
    """The issue's arithmetic, by hand. Tulu 3 8B (Llama-3.1-8B: N = 8,030,261,248 less the
    128,256 x 4096 input embedding), LoRA r = 64 (per layer 64 x (7 x 4096 + 2 x 4096 +
    2 x 1024 + 3 x 14,336)), checkpointing on (8B): 6 N + 8 P + 4 x 2 x 32 x w x 4096 FLOPs per
    token at the measured Alpaca width w = 239.7 of 16 rows, nf4 at 35 % of 312 TFLOP/s;
    48,002 rows / 16 = 3,000 steps an epoch, 30 epochs. 40.9 h of training, ceil(x 60 x 1.25)
    minutes: ceil(3,071 / 720) = 5, and still 5 with up to an hour of evaluation on top."""
    (reg, *_) = plan.plan("+sweep=reg", ["model=tulu", "setting=ood"], "a100_40g")
    n = 8_030_261_248 - 128_256 * 4096
    lora = 32 * 64 * (7 * 4096 + 2 * 4096 + 2 * 1024 + 3 * 14336)
    width = 239.7
    step = 16 * width * (6 * n + 8 * lora + 4 * 2 * 32 * width * 4096) / (312e12 * 0.35)
    train_h = 90_000 * step / 3600
    assert reg.estimate["train_s"] / 3600 == pytest.approx(train_h, rel=1e-9)
    assert 40 < train_h < 42 and reg.estimate["eval_s"] < 3600
    low, high = (math.ceil(math.ceil(h * 60 * 1.25) / 720) for h in (train_h, train_h + 1))
    assert low == high == 5
    limits = plan.job_launcher_limits(reg)
    assert limits["timeout_min"] == limits["limit_min"] == 720
    assert limits["max_num_timeout"] == 5
    assert limits["needed_min"] == math.ceil(reg.estimate["gpu_hours"] * 60 * 1.25)


def test_each_run_call_gets_the_limits_its_own_jobs_need(capsys):
    """The launcher applies one limit to a whole multirun, so a call's limit and requeues are
    its longest job's: a short grid asks for less time (never under an hour: start-up is not
    priced), a user's `hydra.launcher.timeout_min` is the limit the requeues count in."""
    jobs = plan.plan("+sweep=iterate", ["model=tulu", "setting=ood"], "a100_40g")
    longest = max(j.estimate["gpu_hours"] for j in jobs)
    assert math.ceil(longest * 60 * 1.25) < 60  # about 20 minutes
    assert plan.launcher_overrides(jobs) == [
        "hydra.launcher.timeout_min=60", "hydra.launcher.max_num_timeout=1",
    ]  # fmt: skip
    args = ["+sweep=reg", "model=tulu", "setting=ood", "hydra/launcher=slurm",
            "hydra.launcher.timeout_min=2880", "--launcher-overrides"]  # fmt: skip
    assert plan.main(args) == 0
    (reg, *_) = plan.plan("+sweep=reg", ["model=tulu", "setting=ood"], "a100_40g")
    needed = math.ceil(reg.estimate["gpu_hours"] * 60 * 1.25)
    assert capsys.readouterr().out == (
        f"hydra.launcher.timeout_min=2880 hydra.launcher.max_num_timeout="
        f"{math.ceil(needed / 2880)}\n"
    )
