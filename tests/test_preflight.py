"""`calm-lightning preflight`: every job of a sweep checked before submitting, each check's
status and reason, shared checks run once, exit 1 only on a FAIL (planning/preflight.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calm_lightning.planning.preflight import FAIL, PASS, SKIP, WARN, preflight
from calm_lightning.preflight import main

HUB = Path(__file__).parent / "fixtures" / "hub"
MCQA = {n: HUB / f"{n}.jsonl" for n in ("mmlu", "medmcqa", "openbookqa", "arc_challenge")}


def _rows(report, name):
    return [c for c in report.checks if c.name == name or c.name.startswith(name + ".")]


def test_a_broken_job_fails_naming_its_key_and_the_others_are_still_checked():
    """inner_steps=0 breaks one job of three: that job FAILs on `config` naming the key, its
    other checks SKIP, and the other two pass; the data and tokenizer shared by all three
    are read once."""
    reports = preflight(
        "model=tiny", ["method=calm", "setting=demo_id", "method.module.inner_steps=2,0,1"],
        "a100_40g",
    )  # fmt: skip
    assert len(reports) == 3
    bad = reports[1]
    assert bad.status("config") == FAIL and bad.failed
    assert "method.module.inner_steps=0" in _rows(bad, "config")[0].detail
    assert {bad.status(n) for n in ("data", "tokenizer", "model", "memory")} == {SKIP}
    for good in (reports[0], reports[2]):
        assert not good.failed
        assert {good.status(n) for n in ("config", "data", "tokenizer", "model")} == {PASS}
        assert "demo" in _rows(good, "data.test")[0].detail


def test_a_pool_too_small_for_its_split_fails_naming_split_source_and_rows(ood_overrides):
    """The fixtures' MCQA pool holds a few questions; ood_test=3000 asks for more: data FAILs
    with the split, the rows available and the rows asked; Alpaca passes."""
    overrides = [o for o in ood_overrides if not o.startswith("setting.test.sizes.ood_test")]
    reports = preflight("model=tiny", ["method=reg", *overrides], "a100_40g")
    (report,) = reports
    test = _rows(report, "data.test")[0]
    assert test.status == FAIL and report.failed
    assert "ood_test" in test.detail and "3000" in test.detail
    assert _rows(report, "data.train")[0].status == PASS
    assert _rows(report, "data.heldout")[0].status == PASS


def test_offline_with_nothing_cached_is_skip_and_an_unpinned_hub_model_warns(tmp_path, capsys):
    """A Hub model that is not in the cache: tokenizer and model SKIP with the reason, the
    revision WARNs, nothing FAILs (exit 0); the JSON record holds every check."""
    out = tmp_path / "preflight.json"
    # (bf16: this machine has no bitsandbytes, which `auto` would need for a 7B model)
    args = ["model=olmo2", "model.quantization=none", "method=base", "setting=demo_id"]
    code = main([*args, "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    (job,) = json.loads(out.read_text())["jobs"]
    assert "model=olmo2" in job["overrides"]
    status = {c["name"]: c["status"] for c in job["checks"]}
    assert status["tokenizer"] == SKIP and status["model"] == SKIP
    assert status["revision"] == WARN and status["config"] == PASS
    skipped = next(c for c in job["checks"] if c["name"].startswith("tokenizer"))
    assert "offline" in skipped["detail"] or "not cached" in skipped["detail"]
    assert "| 0 | ok | ok | skip | skip |" in printed


def _bitsandbytes(monkeypatch, installed: bool) -> None:
    """Pretend bitsandbytes is (not) installed here, for the plan and the loader's rule."""
    from calm_lightning.models import loading, model_node

    monkeypatch.setattr(model_node, "bitsandbytes_installed", lambda: installed)
    monkeypatch.setattr(loading, "_bitsandbytes_installed", lambda: installed)


def test_quantization_the_plan_assumes_is_checked_against_this_install(monkeypatch):
    """`auto` for a 7B model assumes 4-bit QLoRA: without bitsandbytes it FAILs with the
    install command; with it, or with quantization=none, it passes."""
    args = ["method=base", "setting=demo_id"]
    _bitsandbytes(monkeypatch, False)
    (report,) = preflight("model=olmo2", args, "a100_40g")
    # refused as the GPU node's loader would refuse it, before anything else is read
    (check,) = _rows(report, "config")
    assert check.status == FAIL and "pip install" in check.detail and report.failed
    (report,) = preflight("model=olmo2", [*args, "model.quantization=none"], "a100_40g")
    assert _rows(report, "model.quantization")[0].status == PASS
    _bitsandbytes(monkeypatch, True)
    (report,) = preflight("model=olmo2", args, "a100_40g")
    assert _rows(report, "model.quantization")[0].status == PASS


def test_a_job_longer_than_the_launchers_limit_and_requeues_fails(monkeypatch):
    """Tulu's reg (~41 GPU-h on an A100 40G) under the SLURM launcher's 720 min x (3 + 1):
    FAIL; with the 5 requeues its plan asks for: PASS."""
    _bitsandbytes(monkeypatch, True)  # the GPU nodes' install: the paper's 4-bit QLoRA
    args = ["setting=ood", "hydra/launcher=slurm"]
    (report, *_) = preflight("+sweep=reg", ["model=tulu", *args], "a100_40g")
    (time,) = _rows(report, "time")
    assert time.status == FAIL and "3 requeues" in time.detail
    (report, *_) = preflight(
        "+sweep=reg", ["model=tulu", *args, "hydra.launcher.max_num_timeout=5"], "a100_40g"
    )
    assert _rows(report, "time")[0].status == PASS


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["nonexistent_proj"]])
def test_lora_targets_are_checked_on_the_architecture_without_weights(targets):
    lora = f"peft.target_modules=[{','.join(targets)}]"
    reports = preflight("model=tiny", ["method=reg", "setting=demo_id", lora], "a100_40g")
    (check,) = _rows(reports[0], "model.lora")
    assert check.status == (FAIL if "nonexistent_proj" in targets else PASS), check.detail
    if check.status == FAIL:
        assert "nonexistent_proj" in check.detail and "q_proj" in check.detail


def test_a_tiny_mistral_with_zephyrs_tokenizer_fails_nothing(tiny_mistral_folder):
    """model=mistral from a local folder (Zephyr's real SentencePiece tokenizer and template,
    random weights): BOS once and first, the letters read after the prompt's newline (the
    28741-style ids, not `▁A`), LoRA targets present, nothing FAILs."""
    reports = preflight(
        "model=mistral", [f"model.local_path={tiny_mistral_folder}", "method=calm",
                          "setting=demo_id", "model.quantization=none"], "a100_40g",
    )  # fmt: skip
    (report,) = reports
    assert not report.failed, [c for c in report.checks if c.status == FAIL]
    (bos,) = _rows(report, "tokenizer.bos")
    assert bos.detail == "BOS 1 first, once"
    (options,) = _rows(report, "tokenizer.options")
    assert "bare: [28741," in options.detail and "as trained [28741," in options.detail
    assert {c.name for c in report.checks} >= {"model.vocabulary", "model.lora", "revision"}
