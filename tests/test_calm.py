"""CALM: the BOME direction against the formula, the bilevel step on a convex toy problem with
a known solution, and one real outer step on the tiny model."""

from __future__ import annotations

import copy

import pytest
import torch

from calm_lightning.methods.bome import InnerOptions, bilevel_gradients, bome_direction
from calm_lightning.methods.calm import CALM, STEP_SERIES
from calm_lightning.methods.training import NonFiniteError, warmup_cosine
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import wrap_with_lora

# ----- the pure direction -----


def test_lambda_clipped_at_zero_when_gradients_agree():
    # <f, q> = 1, |q|^2 = 1: eta - 1 = -0.5 < 0, so lambda = 0 and d = grad f.
    out = bome_direction([torch.tensor([1.0, 0.0])], [torch.tensor([1.0, 0.0])], eta=0.5)
    assert out.lam == 0.0
    torch.testing.assert_close(out.direction[0], torch.tensor([1.0, 0.0]))


def test_lambda_positive_over_several_tensors():
    # Blocks flatten into one vector: f = (1, 0 | 2), q = (-1, 1 | 0).
    # <f, q> = -1, |q|^2 = 2, lambda = 0.5 + 0.5 = 1, d = f + q = (0, 1 | 2).
    f = [torch.tensor([1.0, 0.0]), torch.tensor([2.0])]
    q = [torch.tensor([-1.0, 1.0]), torch.tensor([0.0])]
    out = bome_direction(f, q, eta=0.5)
    assert out.lam == pytest.approx(1.0)
    assert out.dot == pytest.approx(-1.0)
    assert out.grad_q_norm == pytest.approx(2**0.5) and out.grad_f_norm == pytest.approx(5**0.5)
    torch.testing.assert_close(out.direction[0], torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(out.direction[1], torch.tensor([2.0]))


def test_zero_residual_gradient_gives_lambda_eta_and_d_equal_f():
    f = [torch.tensor([0.3, -0.2])]
    out = bome_direction(f, [torch.zeros(2)], eta=0.5)
    assert out.lam == pytest.approx(0.5)
    torch.testing.assert_close(out.direction[0], f[0])


def test_none_entries_count_as_zero_and_bf16_accumulates_in_fp32():
    f = [None, torch.full((1000,), 0.01, dtype=torch.bfloat16)]
    q = [torch.tensor([2.0]), torch.full((1000,), -0.01, dtype=torch.bfloat16)]
    out = bome_direction(f, q, eta=0.5)
    qf = torch.full((1000,), 0.01, dtype=torch.bfloat16).float()
    dot = -(qf * qf).sum()
    expected_lam = 0.5 - dot / (4.0 + (qf * qf).sum() + 1e-8)
    assert out.lam == pytest.approx(float(expected_lam), rel=1e-6)
    assert out.direction[1].dtype == torch.bfloat16
    torch.testing.assert_close(out.direction[0], expected_lam * torch.tensor([2.0]))


def test_warmup_then_cosine_schedule():
    factor = warmup_cosine(total_steps=10, warmup_steps=4)
    assert [round(factor(s), 4) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert factor(4) == pytest.approx(1.0)
    assert factor(7) == pytest.approx(0.5)  # half-way through the cosine
    assert factor(10) == pytest.approx(0.0)


# ----- a convex toy bilevel problem with a known solution -----


def test_bilevel_step_converges_on_a_quadratic_toy_problem():
    """Lower: g = 1/2 |theta - A alpha|^2 (so theta*(alpha) = A alpha).
    Upper: f = 1/2 |theta - b|^2. Solution: alpha* = argmin |A alpha - b| (least squares)."""
    torch.manual_seed(0)
    A = torch.tensor([[1.0, 0.5], [0.0, 1.0], [1.0, -1.0]])
    b = torch.tensor([1.0, 2.0, -0.5])
    alpha_star = torch.linalg.lstsq(A, b.unsqueeze(1)).solution.squeeze(1)
    theta = torch.zeros(3, requires_grad=True)
    alpha = torch.zeros(2, requires_grad=True)

    def lower(surrogate, track):
        t = theta if surrogate is None else surrogate[0]
        return 0.5 * (t - A @ alpha).pow(2).sum()

    def upper():
        return 0.5 * (theta - b).pow(2).sum()

    for k in range(1500):
        # BOME reaches the solution as the step size decays (a fixed step leaves a residual
        # of the lower-level constraint proportional to it).
        lr = 0.1 / (1 + k / 100) ** 0.5
        grads = bilevel_gradients([theta], [alpha], lower, upper, InnerOptions(steps=10, lr=0.3))
        step = bome_direction(grads.grad_f, grads.grad_q, eta=0.5)
        with torch.no_grad():
            theta -= lr * step.direction[0]
            alpha -= lr * step.direction[1]
    torch.testing.assert_close(alpha.detach(), alpha_star, atol=5e-3, rtol=0)
    torch.testing.assert_close(theta.detach(), A @ alpha_star, atol=4e-2, rtol=0)


def _quadratic():
    """g(alpha, theta) = 1/2 |theta - A alpha|^2 (theta~ replaces theta when given): A, the
    leaf tensors theta and alpha, and the lower loss in bilevel_gradients' signature."""
    A = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    theta = torch.tensor([0.5, -1.0], requires_grad=True)
    alpha = torch.tensor([0.3, 0.7], requires_grad=True)

    def lower(surrogate, track):
        t = theta if surrogate is None else surrogate[0]
        return 0.5 * (t - A @ alpha).pow(2).sum()

    return A, theta, alpha, lower


def test_residual_gradients_match_the_definition():
    """grad_theta q = grad_theta g(theta) and
    grad_alpha q = grad_alpha g(theta) - grad_alpha g(theta~), with theta~ after T explicit SGD
    steps; computed here by hand for the quadratic."""
    A, theta, alpha, lower = _quadratic()

    def upper():
        return (theta * alpha).sum() + alpha.pow(2).sum()

    T, rho = 3, 0.25
    grads = bilevel_gradients([theta], [alpha], lower, upper, InnerOptions(steps=T, lr=rho))
    with torch.no_grad():
        target = A @ alpha
        t = theta.clone()
        for _ in range(T):
            t = t - rho * (t - target)
        grad_theta_g = theta - target
        grad_alpha_g = -A.T @ (theta - target)
        grad_alpha_g_tilde = -A.T @ (t - target)
    torch.testing.assert_close(grads.grad_q[0], grad_theta_g)
    torch.testing.assert_close(grads.grad_q[1], grad_alpha_g - grad_alpha_g_tilde)
    torch.testing.assert_close(grads.grad_f[0], alpha.detach())
    torch.testing.assert_close(grads.grad_f[1], theta.detach() + 2 * alpha.detach())
    assert grads.q.item() == pytest.approx(
        0.5 * float(grad_theta_g.pow(2).sum()) - 0.5 * float((t - target).pow(2).sum())
    )


# ----- the LightningModule on the tiny model -----


def _tiny_calm(tiny_loaded, head_kind="vector", **kwargs) -> CALM:
    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0], kind=head_kind)
    options = dict(
        inner_steps=2, lower_lr=1e-2, upper_lr=1e-2, warmup_ratio=0.0, inner_optimizer="sgd",
        surrogate={"schedule": "per_step"},
    )  # fmt: skip
    options.update(kwargs)
    return CALM(CalibratedLM(lm, head), tiny_loaded.tokenizer, **options)


def _trainer(tmp_path, steps=1):
    import lightning as L

    return L.Trainer(
        max_epochs=1,
        limit_train_batches=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        accelerator="cpu",
    )


def _snapshot(module: CALM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def test_one_outer_step_updates_adapter_and_head_within_the_clamp(
    demo_datamodule, tiny_loaded, tmp_path
):
    module = _tiny_calm(tiny_loaded, clamp=0.05)
    before = _snapshot(module)
    _trainer(tmp_path).fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))
    after = _snapshot(module)
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    assert {"model.head.scale", "model.head.bias"} <= changed
    assert all(t.abs().max() <= 0.05 + 1e-7 for t in after.values())
    assert any(t.abs().max() == pytest.approx(0.05) for t in after.values())  # clamp was active
    assert module.outer_step == 1


def test_surrogate_loop_never_touches_the_live_parameters(demo_datamodule, tiny_loaded):
    module = _tiny_calm(tiny_loaded, inner_steps=3)
    datamodule = demo_datamodule(tiny_loaded.tokenizer)
    datamodule.setup("fit")
    batch, _, _ = next(iter(datamodule.train_dataloader()))  # CombinedLoader yields triples
    module.upper_objective = "vocab"
    names, theta = module._theta()
    before = _snapshot(module)
    grads = bilevel_gradients(
        theta,
        module._alpha(),
        module.lower_loss_fn(batch["train"], names),
        module.upper_loss_fn(batch["heldout"]),
        InnerOptions(steps=module.inner_steps, lr=module.lower_lr),
    )
    after = _snapshot(module)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(p.grad is None for p in theta)  # autograd.grad leaves .grad alone
    assert grads.q.item() > 0  # three SGD steps on the same batch lowered g
    assert len(grads.grad_f) == len(grads.grad_q) == len(theta) + 2


def test_identity_head_reproduces_the_plain_model(tiny_loaded):
    module = _tiny_calm(tiny_loaded)
    ids = torch.randint(0, 5000, (2, 9))
    mask = torch.ones_like(ids)
    module.model.eval()
    with torch.no_grad():
        adjusted = module.model(ids, mask)
        plain = tiny_loaded.model(input_ids=ids).logits
    torch.testing.assert_close(adjusted, plain)


def test_scalar_head_keeps_the_argmax_after_training(demo_datamodule, tiny_loaded, tmp_path):
    module = _tiny_calm(tiny_loaded, head_kind="scalar", upper_lr=0.05)
    _trainer(tmp_path, steps=2).fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))
    head = module.model.head
    assert head.scale.numel() == 1 and head.scale.item() != 1.0 and head.scale.item() > 0
    z = torch.randn(16, head.vocab_size) * 5
    with torch.no_grad():
        assert torch.equal(head(z).argmax(-1), z.argmax(-1))


def test_non_finite_objective_stops_with_step_and_quantity(
    demo_datamodule, tiny_loaded, tmp_path, monkeypatch
):
    module = _tiny_calm(tiny_loaded)
    original = module.upper_loss_fn

    def poisoned(batch):
        upper = original(batch)
        return lambda: upper() * float("nan")

    monkeypatch.setattr(module, "upper_loss_fn", poisoned)
    before = _snapshot(module)
    with pytest.raises(NonFiniteError, match="CALM step 0: entropy_objective is not finite"):
        _trainer(tmp_path).fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))
    assert (tmp_path / "checkpoints" / "last-good.ckpt").is_file()
    after = _snapshot(module)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_checkpoint_holds_only_trainable_tensors_and_the_outer_step(
    demo_datamodule, tiny_loaded, tmp_path
):
    module = _tiny_calm(tiny_loaded)
    trainer = _trainer(tmp_path)
    trainer.fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    keys = set(checkpoint["state_dict"])
    assert keys == set(_snapshot(module)) and checkpoint["outer_step"] == 1
    # Resume into a fresh module: trainable tensors and the step counter come back.
    fresh = _tiny_calm(tiny_loaded)
    fresh.load_state_dict(checkpoint["state_dict"], strict=False)
    fresh.on_load_checkpoint(checkpoint)
    assert fresh.outer_step == 1
    assert all(torch.equal(v, fresh.state_dict()[k]) for k, v in checkpoint["state_dict"].items())


def test_entropy_matches_the_textbook_formula():
    from calm_lightning.methods.objectives import mean_entropy

    z = torch.randn(7, 50, dtype=torch.float64) * 6
    p = torch.softmax(z, -1)
    expected = -(p * torch.log(p)).sum(-1).mean()
    assert mean_entropy(z).item() == pytest.approx(expected.item(), rel=1e-5)
    uniform = torch.zeros(3, 16)
    assert mean_entropy(uniform).item() == pytest.approx(float(torch.log(torch.tensor(16.0))))


# ----- inner step and surrogate schedules -----


def test_adam_inner_steps_match_torch_adam_with_fresh_moments():
    """inner_optimizer=adam: theta~ after T steps equals torch.optim.Adam (no weight decay)
    started afresh at theta, on the quadratic g = 1/2 |theta - A alpha|^2."""
    A, theta, alpha, lower = _quadratic()

    T, rho, betas = 4, 0.1, (0.9, 0.95)
    grads = bilevel_gradients(
        [theta], [alpha], lower, lambda: theta.sum(),
        InnerOptions(steps=T, lr=rho, optimizer="adam", betas=betas), keep_surrogate=True,
    )  # fmt: skip
    reference = theta.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([reference], lr=rho, betas=betas, eps=1e-8)
    target = (A @ alpha).detach()
    for _ in range(T):
        optimizer.zero_grad()
        (0.5 * (reference - target).pow(2).sum()).backward()
        optimizer.step()
    torch.testing.assert_close(grads.surrogate[0], reference.detach())
    expected_g_tilde = 0.5 * float((reference.detach() - target).pow(2).sum())
    assert grads.g_surrogate.item() == pytest.approx(expected_g_tilde, rel=1e-6)


def _stored(tensors, kind="sgd", rho=0.1):
    from calm_lightning.methods.bome import InnerStep, PersistentSurrogate

    persistent = PersistentSurrogate(InnerStep(kind, rho))
    persistent.tensors = [t.clone() for t in tensors]
    return persistent


def _shifted_quadratic():
    """g = sum (theta - alpha)^2 on two entries; theta and alpha leaf tensors."""
    theta = torch.tensor([1.0, 2.0], requires_grad=True)
    alpha = torch.tensor([0.5], requires_grad=True)

    def lower(surrogate, track):
        t = theta if surrogate is None else surrogate[0]
        return ((t - alpha) ** 2).sum()

    return theta, alpha, lower


def test_a_persistent_surrogate_ahead_of_theta_is_measured_then_stepped():
    """amortized: q = g(theta) - g(stored theta~) with the stored tensors as they are, and the
    stored theta~ then takes one SGD step of its own on this batch (m = 1)."""
    theta, alpha, lower = _shifted_quadratic()
    start = torch.tensor([0.0, 0.5])
    persistent = _stored([start], rho=0.1)
    grads = bilevel_gradients(
        [theta], [alpha], lower, lambda: theta.sum(), InnerOptions(1, 0.1), persistent=persistent
    )
    assert grads.q.item() == pytest.approx((0.5**2 + 1.5**2) - (0.5**2 + 0.0**2))
    # grad_alpha q = -2 sum(theta - alpha) + 2 sum(start - alpha)
    expected = -2 * (0.5 + 1.5) + 2 * (-0.5 + 0.0)
    torch.testing.assert_close(grads.grad_q[1], torch.tensor([expected]))
    # theta~ <- start - rho * 2 (start - alpha), kept for the next outer step
    stepped = start - 0.1 * 2 * (start - 0.5)
    torch.testing.assert_close(persistent.tensors[0], stepped)
    assert persistent.resyncs == 0 and not persistent.resynced
    # The next call starts from the stepped tensors, not from theta.
    again = bilevel_gradients(
        [theta], [alpha], lower, lambda: theta.sum(), InnerOptions(1, 0.1), persistent=persistent
    )
    assert again.g_surrogate.item() == pytest.approx(float(((stepped - 0.5) ** 2).sum()))


def test_a_persistent_surrogate_behind_theta_is_resynchronised():
    """q < 0 with the stored theta~ (theta already does better): theta~ <- theta plus one fresh
    inner step, and q is the drop of that step, computed here by hand."""
    theta, alpha, lower = _shifted_quadratic()
    persistent = _stored([torch.tensor([5.0, -5.0])], kind="adam", rho=0.1)
    persistent.step.count = 7  # moments from earlier steps: a re-sync starts them afresh
    persistent.step.m = [torch.ones(2)]
    persistent.step.v = [torch.ones(2)]
    grads = bilevel_gradients(
        [theta], [alpha], lower, lambda: theta.sum(), InnerOptions(1, 0.1), persistent=persistent
    )
    assert persistent.resyncs == 1 and persistent.resynced
    # A fresh Adam's first step moves every element by rho along the gradient's sign.
    expected = theta.detach() - 0.1 * torch.sign(theta.detach() - 0.5)
    torch.testing.assert_close(persistent.tensors[0], expected)
    g_theta = float(((theta.detach() - 0.5) ** 2).sum())
    assert grads.q.item() == pytest.approx(g_theta - float(((expected - 0.5) ** 2).sum()))
    assert grads.q.item() > 0 and persistent.step.count == 1


def _train_batches(datamodule, n: int) -> list[dict]:
    datamodule.setup("fit")
    batches = [b for b, _, _ in datamodule.train_dataloader()]
    return batches[:n]


def _run_outer_steps(module: CALM, batches: list[dict], feed=None) -> list:
    """Outer steps through `bilevel_update` with plain AdamW optimizers (no trainer)."""
    module.upper_objective = "vocab"
    _, theta = module._theta()
    opt_theta = module.adamw(theta, module.lower_lr)
    opt_alpha = module.adamw(module._alpha(), module.upper_lr)
    out = []
    for batch in batches:
        if feed is not None:
            feed(batch)
        out.append(module.bilevel_update(batch["train"], batch["heldout"], opt_theta, opt_alpha))
    return out


@pytest.mark.integration
def test_amortized_first_step_with_m_equal_t_is_the_per_step_estimator(
    demo_datamodule, tiny_loaded
):
    """Before theta~ exists, the amortized schedule fits it from theta on this batch: with
    m = T steps its first outer step is exactly per_step's; later steps start from the stored
    theta~ instead, and so differ."""
    batches = _train_batches(demo_datamodule(tiny_loaded.tokenizer), 3)
    torch.manual_seed(0)  # the same LoRA initialisation for both
    per_step = _tiny_calm(tiny_loaded, inner_steps=3, lower_lr=0.05)
    torch.manual_seed(0)
    amortized = _tiny_calm(
        tiny_loaded, inner_steps=3, lower_lr=0.05, surrogate={"schedule": "amortized", "steps": 3}
    )
    initial = _snapshot(per_step)
    assert all(torch.equal(v, _snapshot(amortized)[n]) for n, v in initial.items())
    first_p = _run_outer_steps(per_step, batches[:1])[0][0]
    first_a = _run_outer_steps(amortized, batches[:1])[0][0]
    a, b = _snapshot(per_step), _snapshot(amortized)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert first_a.q.item() == pytest.approx(first_p.q.item(), rel=1e-6)
    later_p = _run_outer_steps(per_step, batches[1:])
    later_a = _run_outer_steps(amortized, batches[1:])
    assert later_p[0][0].q.item() != pytest.approx(later_a[0][0].q.item(), rel=1e-6)


def test_amortized_surrogate_keeps_descending_and_never_aliases_theta(demo_datamodule, tiny_loaded):
    """The persistent theta~ moves at every outer step (never frozen), stays separate tensors
    from the live adapters, and g(theta~) on a step's batch is the stored tensors' loss."""
    torch.manual_seed(0)  # the same LoRA initialisation whatever ran before
    batches = _train_batches(demo_datamodule(tiny_loaded.tokenizer), 4)
    module = _tiny_calm(
        tiny_loaded, inner_steps=2, lower_lr=1e-3, inner_lr=0.2,
        surrogate={"schedule": "amortized", "steps": 1},
    )  # fmt: skip
    names, theta = module._theta()
    stored, expected, resynced = [], [], []

    def check(batch):
        if stored:  # the previous step (one whose g(theta~) is compared) is done
            resynced.append(module.persistent.resynced)
        tensors = module.persistent.tensors
        if tensors is not None:
            stored.append([t.clone() for t in tensors])
            live = {p.data_ptr() for p in theta}
            assert not any(t.data_ptr() in live for t in tensors)
            with torch.no_grad():
                expected.append(module.lower_loss_fn(batch["train"], names)(tensors, False))

    results = _run_outer_steps(module, batches, feed=check)
    resynced.append(module.persistent.resynced)  # the last step's
    assert len(stored) == 3 and len(resynced) == 3
    for before, after in zip(stored, stored[1:], strict=False):
        assert not all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    # A step that re-synchronises refits theta~ from theta first, so its g(theta~) is not the
    # stored tensors' loss; every other step's must be (checked per step, not on the last).
    compared = 0
    for (grads, _), value, refit in zip(results[1:], expected, resynced, strict=True):
        if not refit:
            assert grads.g_surrogate.item() == pytest.approx(value.item(), rel=1e-6)
            compared += 1
    assert compared >= 1
    assert all(grads.q.item() >= 0 for grads, _ in results)  # ahead, or re-synced


def test_residual_passes_run_without_dropout_unless_asked(demo_datamodule, tiny_loaded):
    """LoRA dropout 0.5, train mode: the lower loss is deterministic when residual_dropout is
    off (q measures the inner steps) and differs between two calls when it is on."""
    batch = _train_batches(demo_datamodule(tiny_loaded.tokenizer), 1)[0]["train"]
    values = {}
    for flag in (False, True):
        lm = wrap_with_lora(
            copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8, "lora_dropout": 0.5}
        )
        head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0])
        module = CALM(
            CalibratedLM(lm, head), tiny_loaded.tokenizer, inner_optimizer="sgd",
            surrogate={"schedule": "per_step"}, residual_dropout=flag,
        )  # fmt: skip
        with torch.no_grad():  # B = 0 at init: make the adapters (and their dropout) matter
            for name, p in module.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
        module.train()
        names, _ = module._theta()
        lower = module.lower_loss_fn(batch, names)
        torch.manual_seed(0)
        values[flag] = [lower(None, False).item() for _ in range(2)]
        assert all(m.training for m in module.modules() if isinstance(m, torch.nn.Dropout))
    assert values[False][0] == values[False][1]
    assert values[True][0] != values[True][1]


def test_inner_drop_is_g_theta_minus_g_surrogate_by_hand(demo_datamodule, tiny_loaded, tmp_path):
    """per_step: the logged residual q is g(theta) - g(theta~) with theta~ after T SGD steps
    of size inner_lr (not lower_lr) on the step's batch, computed here by hand."""
    import lightning as L

    from calm_lightning.methods.objectives import adjusted_predictions, cross_entropy

    module = _tiny_calm(tiny_loaded, inner_steps=3, lower_lr=1e-3, inner_lr=0.5)
    captured = {}

    class Capture(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            names, theta = pl_module._theta()
            captured["theta"] = {n: p.detach().clone() for n, p in zip(names, theta, strict=True)}
            captured["batch"] = batch["train"]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            captured["q"] = float(trainer.callback_metrics["calm/q"])
            captured["q_rel"] = float(trainer.callback_metrics["calm/q_rel"])
            captured["g"] = float(trainer.callback_metrics["calm/g"])
            captured["logged"] = set(trainer.callback_metrics)

    trainer = L.Trainer(
        max_epochs=1, limit_train_batches=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        accelerator="cpu", callbacks=[Capture()],
    )  # fmt: skip
    head = {k: v.detach().clone() for k, v in module.model.head.state_dict().items()}
    trainer.fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))
    # The series the sweep dashboard plots for the picked run are among those logged.
    assert set(STEP_SERIES) <= captured["logged"]
    module.model.head.load_state_dict(head)  # alpha as it was during the step
    batch = captured["batch"]

    def g(params):
        raw = module.model.raw_logits(batch["input_ids"], batch["attention_mask"], params=params)
        logits, targets = adjusted_predictions(module.model, raw, batch["labels"], "vocab", None)
        return cross_entropy(logits, targets)

    surrogate = {k: v.clone().requires_grad_(True) for k, v in captured["theta"].items()}
    for _ in range(3):
        grads = torch.autograd.grad(g(surrogate), list(surrogate.values()))
        surrogate = {
            k: (v - 0.5 * gr).detach().requires_grad_(True)
            for (k, v), gr in zip(surrogate.items(), grads, strict=True)
        }
    with torch.no_grad():
        expected = g(captured["theta"]) - g(surrogate)
    assert captured["q"] == pytest.approx(expected.item(), rel=1e-4)  # per_step: q is the drop
    assert captured["q_rel"] == pytest.approx(captured["q"] / captured["g"], rel=1e-6)
    assert expected.item() > 1e-3  # inner_lr 0.5 moved the surrogate (1e-3 would barely)


@pytest.mark.integration
def test_amortized_surrogate_goes_into_the_checkpoint(demo_datamodule, tiny_loaded, tmp_path):
    amortized = {"schedule": "amortized", "steps": 1}
    module = _tiny_calm(tiny_loaded, inner_optimizer="adam", surrogate=amortized)
    trainer = _trainer(tmp_path, steps=2)
    trainer.fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))
    path = tmp_path / "c.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    names, _ = module._theta()
    saved = checkpoint["calm_surrogate"]
    assert list(saved["tensors"]) == names and saved["inner"]["count"] >= 1
    assert len(checkpoint["calm_history"]) == 2
    fresh = _tiny_calm(tiny_loaded, inner_optimizer="adam", surrogate=amortized)
    fresh.on_load_checkpoint(checkpoint)
    kept, restored = module.persistent, fresh.persistent
    assert all(torch.equal(a, b) for a, b in zip(restored.tensors, kept.tensors, strict=True))
    assert restored.step.count == kept.step.count
    assert all(torch.equal(a, b) for a, b in zip(restored.step.v, kept.step.v, strict=True))
    assert fresh.history == module.history


@pytest.mark.integration
def test_a_run_plots_its_outer_step_curves(demo_datamodule, tiny_loaded, tmp_path):
    module = _tiny_calm(tiny_loaded, surrogate={"schedule": "amortized", "steps": 1})
    fitted = module.calibrate(_trainer(tmp_path, steps=3), demo_datamodule(tiny_loaded.tokenizer))
    assert (tmp_path / "calm_steps.png").stat().st_size > 10_000
    steps = fitted["calm_steps"]
    assert steps["outer_steps"] == 3 and steps["q_first"] == module.history[0]["q"]
    assert steps["lambda_mean"] == pytest.approx(sum(h["lambda"] for h in module.history) / 3)


@pytest.mark.parametrize(
    "surrogate", [None, {"schedule": "sometimes"}, {"schedule": "amortized", "steps": 0},
                  {"schedule": "amortized", "every": 2}],
)  # fmt: skip
def test_bad_surrogate_settings_are_refused(tiny_loaded, surrogate):
    from calm_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match="surrogate"):
        _tiny_calm(tiny_loaded, surrogate=surrogate)


# ----- step budgets count outer steps -----


def _regularization(tiny_loaded):
    from calm_lightning.methods.single_level import Regularization

    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    return Regularization(CalibratedLM(lm, None), tiny_loaded.tokenizer, lr=1e-2, warmup_ratio=0)


def _iterate(tiny_loaded):
    from calm_lightning.methods.iterate import Iterate

    lm = wrap_with_lora(copy.deepcopy(tiny_loaded.model), {"r": 4, "lora_alpha": 8})
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0])
    model = CalibratedLM(lm, head)
    return Iterate(model, tiny_loaded.tokenizer, lower_steps=1, warmup_ratio=0.0)


@pytest.mark.integration
@pytest.mark.parametrize("method", ["calm", "reg", "iterate"])
def test_max_steps_gives_that_many_outer_steps_batches_and_a_full_schedule(
    demo_datamodule, tiny_loaded, tmp_path, method
):
    """Every training method steps its optimizers by hand; CALM (two optimizers per outer
    step) and Iterate (one more per upper step) must still count one step per batch."""
    import lightning as L

    build = {"calm": _tiny_calm, "reg": _regularization, "iterate": _iterate}[method]
    module = build(tiny_loaded)
    batches = []

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            batches.append(batch_idx)

    trainer = L.Trainer(
        max_steps=3, max_epochs=5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        accelerator="cpu", callbacks=[Count()],
    )  # fmt: skip
    trainer.fit(module, datamodule=demo_datamodule(tiny_loaded.tokenizer))  # 4 batches per epoch
    assert len(batches) == 3 and module.outer_step == 3 and trainer.global_step == 3
    for scheduler in trainer.lr_scheduler_configs:
        assert scheduler.scheduler.last_epoch == 3
        # warmup_ratio 0: the cosine over 3 steps has reached its end (min_lr_ratio 0).
        assert scheduler.scheduler.get_last_lr()[0] == pytest.approx(0.0, abs=1e-12)
