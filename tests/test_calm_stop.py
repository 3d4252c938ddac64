"""CALM with a stopping point (`method=calm_stop`): each switch against an independent
computation, and the head's stop on a temperature problem whose answer scipy gives."""

from __future__ import annotations

import math

import pytest
import torch

from calm_lightning.methods.bome import InnerOptions, bilevel_gradients, bome_direction
from calm_lightning.models.logit_adjustment import LogitAdjustment

# ----- log-space head -----


def test_log_head_is_temperature_scaling_with_gradient_d_times_the_linear_one():
    """d = exp(s); dCE/ds = d * dCE/dd, with dCE/dd = E_p[z] - z_y for CE of softmax(d z)."""
    torch.manual_seed(0)
    z = torch.randn(7, 5) * 3
    y = torch.randint(0, 5, (7,))
    head = LogitAdjustment(5, kind="scalar", parameterization="log")
    with torch.no_grad():
        head.log_scale.fill_(math.log(0.4))
    torch.testing.assert_close(torch.softmax(head(z), -1), torch.softmax(0.4 * z, -1))
    torch.nn.functional.cross_entropy(head(z), y).backward()
    p = torch.softmax(0.4 * z, -1)
    dce_dd = ((p * z).sum(-1) - z.gather(1, y[:, None]).squeeze(1)).mean()
    assert head.log_scale.grad.item() == pytest.approx(0.4 * dce_dd.item(), rel=1e-5)
    assert list(dict(head.named_parameters())) == ["log_scale", "bias"]


def test_log_head_saves_d_and_loads_as_the_same_function(tmp_path):
    head = LogitAdjustment(9, kind="vector", center="logsumexp", parameterization="log")
    with torch.no_grad():
        head.log_scale.normal_()
        head.bias.normal_()
    head.save(tmp_path)
    loaded = LogitAdjustment.load(tmp_path)
    assert loaded.parameterization == "linear"
    z = torch.randn(3, 9) * 5
    torch.testing.assert_close(loaded(z), head(z))


# ----- per-block lambda -----


def test_per_block_lambda_is_the_formula_on_each_block_alone():
    torch.manual_seed(1)
    f = [torch.randn(4, 3), torch.randn(5), torch.randn(1)]
    q = [torch.randn(4, 3), torch.randn(5), torch.randn(1)]
    step = bome_direction(f, q, eta=0.5, blocks=(2, 1))
    for (start, stop), lam in zip(((0, 2), (2, 3)), step.lambdas, strict=True):
        dot = sum(float((a * b).sum()) for a, b in zip(f[start:stop], q[start:stop], strict=True))
        q_sq = sum(float(b.pow(2).sum()) for b in q[start:stop])
        assert lam == pytest.approx(max(0.0, 0.5 - dot / (q_sq + 1e-8)), rel=1e-5, abs=1e-7)
        for i in range(start, stop):
            torch.testing.assert_close(step.direction[i], f[i] + lam * q[i])
    whole = bome_direction(f, q, eta=0.5)
    assert bome_direction(f, q, eta=0.5, blocks=(3,)).lambdas == whole.lambdas
    with pytest.raises(ValueError, match="partition"):
        bome_direction(f, q, blocks=(1, 1))


def test_per_block_lambda_lets_a_small_block_brake_where_one_lambda_does_not():
    """A big adapter block whose gradients agree outvotes the head's conflict under one lambda
    (lambda = 0: the head follows the entropy alone); per block, the head's step is the
    constraint's own descent eta * grad_q (its entropy part cancelled)."""
    f = [torch.full((100,), 1.0), torch.tensor([2.0])]
    q = [torch.full((100,), 1.0), torch.tensor([-0.5])]
    one = bome_direction(f, q, eta=0.5)
    assert one.lam == 0.0 and one.direction[1].item() == pytest.approx(2.0)
    per = bome_direction(f, q, eta=0.5, blocks=(1, 1))
    assert per.lambdas[1] == pytest.approx(0.5 + 2.0 / 0.5, rel=1e-6)
    assert per.direction[1].item() == pytest.approx(0.5 * -0.5, rel=1e-5)


# ----- joint value function on a temperature problem with a known optimum -----


def _toy():
    """studies/calm_stop_toy.py: the synthetic temperature problem and its head loop."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "studies" / "calm_stop_toy.py"
    spec = importlib.util.spec_from_file_location("calm_stop_toy", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("start", [0.0, -2.5])  # d = 1 (over-confident), d = e^-2.5 (under)
def test_joint_value_gives_the_head_the_cross_entropys_own_slope(start):
    """Under the joint value function grad_alpha q = grad_alpha g(alpha, theta) whatever the
    surrogate did, and its sign says on which side of scipy's CE-optimal head alpha is."""
    toy = _toy()
    logits, y, heldout = toy.temperature_problem()
    best = -math.log(toy.ce_optimal_temperature(logits, y))  # log d at the optimum
    theta = torch.zeros(logits.shape[1], requires_grad=True)
    s = torch.tensor([start], requires_grad=True)
    lower, upper = toy.head_losses(logits, y, heldout, theta, s, log=True)
    grads = bilevel_gradients(
        [theta], [s], lower, upper,
        InnerOptions(steps=5, lr=0.1, optimizer="adam", joint_value=True),
    )  # fmt: skip
    expected = torch.autograd.grad(lower(None, True), [s])[0]
    torch.testing.assert_close(grads.grad_q[1], expected)
    assert math.copysign(1.0, grads.grad_q[1].item()) == math.copysign(1.0, start - best)
    # the surrogate stepped the head's copy too: q measures the joint inner drop
    assert grads.q.item() > 0


def test_the_variants_head_stops_at_the_ce_optimum_whatever_its_budget():
    """k = 4: the variant's head ends within 20 % of scipy's CE-optimal temperature at upper
    LR 0.3 and 1 (12 steps) and at 0.3 over 48 steps; the paper's form at the same budgets
    ends where LR x steps put it (spread far above 20 %); the variant with AdamW's momentum
    for the head overshoots at the larger LR."""
    toy = _toy()
    problem = toy.temperature_problem(k=4.0)
    optimum = toy.ce_optimal_temperature(*problem[:2])
    assert 3.0 < optimum < 5.0  # the known temperature, up to sampling
    budgets = [(0.3, 12), (1.0, 12), (0.3, 48)]
    variant = [toy.final_temperature(problem, lr, n, toy.VARIANT) for lr, n in budgets]
    assert all(abs(t / optimum - 1) < 0.2 for t in variant), (optimum, variant)
    paper_budgets = [(0.03, 12), (0.1, 12), (0.03, 48)]
    paper = [toy.final_temperature(problem, lr, n, toy.PAPER) for lr, n in paper_budgets]
    assert max(paper) / min(paper) > 1.5, paper
    momentum = {**toy.VARIANT, "sign": False}
    assert toy.final_temperature(problem, 1.0, 12, momentum) > 2 * optimum


# ----- the LightningModule with the switches -----


def test_sign_head_step_moves_the_log_scale_by_the_lr(tiny_calm_stop, fit_on_demo):
    """One outer step: s moves by exactly lr * sign(direction) (plus decoupled decay of a zero
    s: nothing), the surrogate holds adapter and head copies, lambda_head is logged."""
    module = tiny_calm_stop()
    fit_on_demo(module)
    s = module.model.head.log_scale.detach()
    assert abs(s.item()) == pytest.approx(0.3, rel=1e-6)
    record = module.history[-1]
    assert "lambda_head" in record and record["d_mean"] == pytest.approx(math.exp(s.item()))
    n_theta = len(module.model.adapter_parameters())
    assert len(module.persistent.tensors) == n_theta + 2
    names = module._surrogate_names()
    assert names[-2:] == ["head.log_scale", "head.bias"]


def test_joint_surrogate_survives_a_checkpoint(tiny_calm_stop, fit_on_demo, tmp_path):
    module = tiny_calm_stop()
    trainer = fit_on_demo(module, steps=2)
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert list(checkpoint["calm_surrogate"]["tensors"])[-2:] == ["head.log_scale", "head.bias"]
    restored = tiny_calm_stop()
    restored.on_load_checkpoint(checkpoint)
    for a, b in zip(module.persistent.tensors, restored.persistent.tensors, strict=True):
        assert torch.equal(a, b)


def test_the_variant_switches_are_one_checked_block(tiny_calm_stop):
    """The research switches live in `method.module.variant`: a misspelt switch is refused
    naming the allowed ones, a missing one keeps the paper's form."""
    from calm_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"variant=.*unknown keys \['head_stepp'\]"):
        tiny_calm_stop(variant={"head_stepp": "sign"})
    module = tiny_calm_stop(variant={"lambda_blocks": "per_block"})
    assert module.per_block_lambda and not module.joint_value and module.head_step == "adamw"
