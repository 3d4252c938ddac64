"""`method=calm_token`: the per-token head on a support, against hand-written arithmetic, and the
method's blocks, optimizers and support on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from calm_lightning.methods.calm_token import CALMToken, answer_texts
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.token_head import TokenLogitAdjustment


def _head(**kwargs) -> TokenLogitAdjustment:
    head = TokenLogitAdjustment(7, support=[4, 1], **kwargs)
    with torch.no_grad():
        head.log_scale.fill_(math.log(0.5))
        head.bias.copy_(torch.tensor([2.0, -1.0]))  # support sorted: token 1 -> 2, token 4 -> -1
    return head


def test_token_head_is_a_temperature_plus_biases_on_its_support_only():
    torch.manual_seed(0)
    z = torch.randn(3, 7) * 4
    expected = 0.5 * z
    expected[:, 1] += 2.0
    expected[:, 4] -= 1.0
    head = _head()
    torch.testing.assert_close(head(z), expected)
    ids = torch.tensor([4, 0])
    torch.testing.assert_close(head(z, ids), expected[:, [4, 0]])
    assert head.support.tolist() == [1, 4]
    assert list(dict(head.named_parameters())) == ["log_scale", "bias"]


def test_token_head_with_zero_entries_is_the_scalar_head_and_starts_as_the_identity():
    z = torch.randn(2, 7)
    assert torch.equal(TokenLogitAdjustment(7, support=[0, 3])(z), z)
    head = TokenLogitAdjustment(7, support=[0, 3])
    scalar = LogitAdjustment(7, kind="scalar", parameterization="log")
    with torch.no_grad():
        head.log_scale.fill_(0.7)
        scalar.log_scale.fill_(0.7)
    torch.testing.assert_close(head(z), scalar(z))


def test_token_scales_multiply_the_shared_one_on_the_support():
    head = _head(token_scale=True)
    with torch.no_grad():
        head.token_log_scale.copy_(torch.tensor([math.log(3.0), 0.0]))
    z = torch.randn(2, 7)
    expected = 0.5 * z
    expected[:, 1] = 1.5 * z[:, 1] + 2.0
    expected[:, 4] -= 1.0
    torch.testing.assert_close(head(z), expected)
    # CALM's logs read the scale at -2 only without per-token scales; the entries come last
    assert list(dict(head.named_parameters()))[-1] == "bias"


def test_token_head_saves_and_loads_as_the_same_vector_head(tmp_path):
    head = _head(token_scale=True)
    with torch.no_grad():
        head.token_log_scale.normal_()
    head.save(tmp_path)
    loaded = LogitAdjustment.load(tmp_path)
    assert loaded.kind == "vector"
    z = torch.randn(5, 7) * 3
    torch.testing.assert_close(loaded(z), head(z))
    torch.testing.assert_close(head.to_vector()(z), head(z))


def test_a_support_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TokenLogitAdjustment(7, support=[2, 7])


def test_answer_texts_read_each_record_kind():
    from calm_lightning.data.records import InstructionRecord, MCQARecord

    question = MCQARecord(id="q", question="?", choices=("red", "blue"), answer=1)
    instruction = InstructionRecord(instruction="say hi", input="", output="hi there")
    assert answer_texts(question) == ["blue"]
    assert answer_texts(instruction) == ["hi there"]


def _tiny_token(tiny_calm_stop, **kwargs) -> CALMToken:
    options = dict(support="responses", support_size=50, token_lr=0.05, token_weight_decay=0.0)
    return tiny_calm_stop(CALMToken, **{**options, **kwargs})


def test_one_outer_step_moves_each_block_by_its_own_rule(tiny_calm_stop, fit_on_demo):
    """Three lambdas (adapters, d0, entries); d0 moves by exactly its LR (sign descent), every
    entry by at most the entries' LR (Adam's first step: lr * g / |g|), the vocabulary outside
    the support not at all; the surrogate carries the entries at their own inner LR."""
    module = _tiny_token(tiny_calm_stop)
    fit_on_demo(module)
    head = module.model.head
    assert 0 < head.support.numel() <= 50
    assert abs(head.log_scale.item()) == pytest.approx(0.3, rel=1e-6)
    moved = head.bias.detach().abs()
    assert moved.max() == pytest.approx(0.05, rel=1e-3) and moved.max() <= 0.05 * (1 + 1e-5)
    d, bias = head.dense()
    outside = torch.ones(head.vocab_size, dtype=torch.bool)
    outside[head.support] = False
    assert torch.all(bias[outside] == 0) and torch.all(d == d[0])
    record = module.history[-1]
    assert {"lambda", "lambda_scale", "lambda_head"} <= set(record)
    n_theta = len(module.model.adapter_parameters())
    assert module._blocks(n_theta, 2) == (n_theta, 1, 1)
    assert module.persistent.step.lr[-2:] == [0.3, 0.05]


@pytest.mark.parametrize("schedule", ["per_step", "amortized"])
def test_the_surrogate_steps_the_entries_at_token_lr_under_both_schedules(
    tiny_calm_stop, fit_on_demo, monkeypatch, schedule
):
    """One source for the head's inner step: whichever schedule forms theta~, its copy of d0
    steps at upper_lr and its copies of the entries at token_lr (per_step once stepped them at
    upper_lr). The step sizes are read where the inner rule applies them."""
    from calm_lightning.methods import bome

    used = []
    original = bome.InnerStep.__call__

    def spy(self, tensors, gradients):
        used.append(self._lrs(len(tensors)))
        return original(self, tensors, gradients)

    monkeypatch.setattr(bome.InnerStep, "__call__", spy)
    surrogate = {"schedule": schedule, "steps": 1}
    module = _tiny_token(tiny_calm_stop, token_lr=0.02, surrogate=surrogate)
    fit_on_demo(module)
    assert used, "no inner step ran"
    n_theta = len(module.model.adapter_parameters())
    for lrs in used:
        assert lrs == [1e-2] * n_theta + [0.3, 0.02]


def test_a_frozen_entry_lr_leaves_a_temperature(tiny_calm_stop, fit_on_demo):
    module = _tiny_token(tiny_calm_stop, token_lr=0.0)
    fit_on_demo(module)
    assert torch.all(module.model.head.bias == 0)
    assert abs(module.model.head.log_scale.item()) == pytest.approx(0.3, rel=1e-6)


def test_options_support_on_instruction_data_is_refused_with_what_to_do(
    tiny_calm_stop, fit_on_demo
):
    from calm_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="support=responses"):
        fit_on_demo(_tiny_token(tiny_calm_stop, support="options"))


@pytest.mark.integration
def test_calm_token_runs_through_the_pipeline_under_cloze_scoring(compose, tmp_path):
    """demo_id under cloze scoring: the support is the train / held-out option-text tokens; the
    run records the entries' summary and saves the dense vector head."""
    from calm_lightning.pipeline import run_experiment

    cfg = compose(
        ["model=tiny", "method=calm_token", "setting=demo_id", "evaluation.scoring=cloze",
         "peft.r=4", "setting.test.limit=8", "trainer.limit_train_batches=2",
         "setting.max_length=96", "logger=none", "trainer.enable_progress_bar=false",
         "evaluation.compare_with_base=false"],
        output_dir=tmp_path,
    )  # fmt: skip
    run_experiment(cfg)
    record = json.loads((tmp_path / "metrics.json").read_text())
    summary = record["token_head"]
    assert summary["support"] > 10 and summary["l_abs_max"] > 0
    head = LogitAdjustment.load(tmp_path / "calibration")
    assert head.kind == "vector" and int((head.bias != 0).sum()) <= summary["support"]
