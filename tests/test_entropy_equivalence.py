"""One outer step of paper-form CALM with its head frozen moves the adapters as one step of
`reg` with alpha_reg = 1 / lambda and the entropy on the held-out batch.

CALM's adapter direction is grad f + lambda grad_theta q with f = -H(held-out) and
grad_theta q = grad_theta CE(train) (the surrogate is a stopped gradient), i.e. lambda times
the gradient of CE(train) - (1 / lambda) H(held-out); AdamW's first step ignores a positive
factor on its gradient up to its eps (docs/studies/entropy_equivalence.md)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from calm_lightning.errors import ConfigError
from calm_lightning.methods.calm import CALM
from calm_lightning.methods.single_level import Regularization
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import wrap_with_lora

LR = 1e-2  # CALM's lower LR = reg's LR
EPS = 1e-8  # AdamW's eps (TrainingMethod.adamw keeps torch's default)


def _adapters(tiny_loaded):
    """Rank-4 LoRA (no dropout) whose B is not zero, so that both factors get gradients (with
    peft's B = 0 every lora_A gradient vanishes and only half the identity would be tested)."""
    torch.manual_seed(0)
    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=generator))
    return lm


def _pair(demo_datamodule, tokenizer) -> dict:
    datamodule = demo_datamodule(tokenizer)
    datamodule.setup("fit")
    batch, _, _ = next(iter(datamodule.train_dataloader()))  # CombinedLoader yields triples
    return batch


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def _reference_loss(model, train: dict, heldout: dict, alpha: float) -> torch.Tensor:
    """CE on the training batch's response tokens minus alpha times the mean textbook entropy
    of the held-out batch's response positions (torch.distributions, not objectives.py)."""

    def rows(batch):
        logits = model.raw_logits(batch["input_ids"], batch["attention_mask"])
        keep = batch["labels"][:, 1:] != -100  # position t predicts token t + 1
        return logits[:, :-1][keep].float(), batch["labels"][:, 1:][keep]

    logits, targets = rows(train)
    entropy = torch.distributions.Categorical(logits=rows(heldout)[0]).entropy().mean()
    return F.cross_entropy(logits, targets) - alpha * entropy


def test_a_frozen_head_calm_step_is_reg_with_alpha_one_over_lambda_on_heldout_entropy(
    demo_datamodule, tiny_loaded
):
    batch = _pair(demo_datamodule, tiny_loaded.tokenizer)
    lm = _adapters(tiny_loaded)
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0], kind="vector")
    # The paper's form (one lambda over adapters and head, lower value function), head frozen.
    calm = CALM(CalibratedLM(copy.deepcopy(lm), head), tiny_loaded.tokenizer, inner_steps=2,
                lower_lr=LR, upper_lr=0.0, warmup_ratio=0.0, inner_optimizer="adam",
                surrogate={"schedule": "per_step"})  # fmt: skip
    calm.upper_objective = "vocab"  # resolved from the data in on_fit_start otherwise
    _, theta = calm._theta()
    start = [t.detach().clone() for t in theta]
    head_start = [t.detach().clone() for t in calm._alpha()]
    opt_theta, opt_alpha = calm.adamw(theta, LR), calm.adamw(calm._alpha(), 0.0)
    _, step = calm.bilevel_update(batch["train"], batch["heldout"], opt_theta, opt_alpha)
    lam = step.lam
    assert 0 < lam < calm.eta  # the two gradients agree in part: lambda is interior
    calm_direction = _flat(step.direction[: len(theta)])
    calm_delta = _flat(theta) - _flat(start)
    assert all(torch.equal(a, b) for a, b in zip(calm._alpha(), head_start, strict=True))

    # reg on the same batch pair, from the same adapters, with alpha = 1 / lambda of that step.
    reg = Regularization(CalibratedLM(copy.deepcopy(lm), None), tiny_loaded.tokenizer, lr=LR,
                         warmup_ratio=0.0, alpha_reg=1 / lam, entropy_on="heldout")  # fmt: skip
    params = [p for p in reg.model.parameters() if p.requires_grad]
    assert len(params) == len(theta)
    loss, _ = reg.loss(batch["train"], heldout=batch["heldout"])
    expected = _reference_loss(reg.model, batch["train"], batch["heldout"], 1 / lam)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    reg_gradient = torch.autograd.grad(loss, params)

    # The directions: CALM's is lambda times reg's (float32 sums in different orders: 1e-4).
    scaled = lam * _flat(reg_gradient)
    assert F.cosine_similarity(calm_direction, scaled, dim=0) > 1 - 1e-6
    assert (calm_direction - scaled).norm() / calm_direction.norm() < 1e-4

    # One AdamW step each: the first step is -lr g / (|g| + eps) (+ the same weight decay), so
    # the factor lambda (0 < lambda < 1) cancels up to eps: element by element the two steps
    # differ by at most lr * eps / |D|. Checked where |D| >= 1e3 eps (99 % of the elements
    # here, so the bound is <= 1e-3 lr); the rest are gradients within three decades of eps.
    for param, gradient in zip(params, reg_gradient, strict=True):
        param.grad = gradient
    reg.adamw(params, LR).step()
    reg_delta = _flat(params) - _flat(start)
    far_from_eps = calm_direction.abs() >= 1e3 * EPS
    assert far_from_eps.float().mean() > 0.98
    gap = (calm_delta - reg_delta).abs()
    # + the float32 rounding of the stepped parameter (a few ulp of |theta| + lr)
    rounding = 4 * torch.finfo(torch.float32).eps * (_flat(start).abs() + LR)
    bound = LR * EPS / calm_direction.abs().clamp(min=EPS) + rounding
    assert (gap <= bound)[far_from_eps].all()
    assert F.cosine_similarity(calm_delta, reg_delta, dim=0) > 1 - 1e-5
    assert calm_delta.abs().max() > 0.5 * LR  # the adapters really moved (about lr a step)


def test_reg_takes_its_entropy_on_the_paired_heldout_batch_in_a_fit(
    demo_datamodule, tiny_loaded, fit_on_demo
):
    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    reg = Regularization(CalibratedLM(lm, None), tiny_loaded.tokenizer, lr=LR, warmup_ratio=0.0,
                         alpha_reg=0.5, entropy_on="heldout")  # fmt: skip
    seen = []
    loss = reg.loss

    def spy(batch, heldout=None):
        seen.append((list(batch["ids"]), None if heldout is None else list(heldout["ids"])))
        return loss(batch, heldout)

    reg.loss = spy
    fit_on_demo(reg, steps=2)
    assert len(seen) == 2
    for train_ids, heldout_ids in seen:
        assert all(i.startswith("instructions_train") for i in train_ids)
        assert heldout_ids and all(i.startswith("instructions_heldout") for i in heldout_ids)


def test_reg_defaults_to_the_training_batch_entropy(tiny_loaded, demo_datamodule):
    """`entropy_on: train` (the default, the paper's baseline): H of the training batch."""
    batch = _pair(demo_datamodule, tiny_loaded.tokenizer)
    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    reg = Regularization(CalibratedLM(lm, None), tiny_loaded.tokenizer, alpha_reg=0.5)
    assert reg.entropy_on == "train"
    loss, _ = reg.batch_loss(batch)
    expected = _reference_loss(reg.model, batch["train"], batch["train"], 0.5)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_heldout_entropy_needs_heldout_data(compose, tmp_path):
    from calm_lightning.methods.base import method_class

    cfg = compose(["method=reg", "method.module.entropy_on=heldout"], tmp_path)
    with pytest.raises(ConfigError, match="entropy_on=heldout needs held-out data"):
        method_class(cfg).check_requirements(cfg, {})  # a setting without setting.heldout
    method_class(cfg).check_requirements(cfg, {"heldout": object()})
    plain = compose(["method=reg"], tmp_path)
    method_class(plain).check_requirements(plain, {})


def test_unknown_entropy_on_is_refused(tiny_loaded):
    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    with pytest.raises(ConfigError, match="entropy_on"):
        Regularization(CalibratedLM(lm, None), tiny_loaded.tokenizer, entropy_on="test")
