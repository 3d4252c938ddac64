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
    code = main(["model=olmo2", "method=base", "setting=demo_id", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    (job,) = json.loads(out.read_text())["jobs"]
    assert "model=olmo2" in job["overrides"]
    status = {c["name"].split(".")[0]: c["status"] for c in job["checks"]}
    assert status["tokenizer"] == SKIP and status["model"] == SKIP
    assert status["revision"] == WARN and status["config"] == PASS
    skipped = next(c for c in job["checks"] if c["name"].startswith("tokenizer"))
    assert "offline" in skipped["detail"] or "not cached" in skipped["detail"]
    assert "| 0 | ok | ok | skip | skip |" in printed


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["nonexistent_proj"]])
def test_lora_targets_are_checked_on_the_architecture_without_weights(targets):
    lora = f"peft.target_modules=[{','.join(targets)}]"
    reports = preflight("model=tiny", ["method=reg", "setting=demo_id", lora], "a100_40g")
    (check,) = _rows(reports[0], "model.lora")
    assert check.status == (FAIL if "nonexistent_proj" in targets else PASS), check.detail
    if check.status == FAIL:
        assert "nonexistent_proj" in check.detail and "q_proj" in check.detail
