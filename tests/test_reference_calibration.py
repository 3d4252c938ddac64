"""DACA / Dual-Align building blocks against hand computations and scipy, the logit lens against
the model's own output, and temperature recovery on PoLM = PLM with scaled logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.spatial.distance import jensenshannon

from calm_lightning.calibrators.reference import (
    agreement_mask,
    daca_loss,
    divergence_weight,
    dual_align_loss,
    dual_align_targets,
    fit_temperature_adam,
    inferential_stability_entropy,
    jensen_shannon,
    layer_divergence,
    peak_divergence_layer,
)
from calm_lightning.models.logit_lens import lens_option_logits


def _h(p) -> float:
    p = np.asarray(p, dtype=float)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def test_jensen_shannon_against_scipy_and_its_bounds():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.7, 0.2, 0.1], [1.0, 0.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.9, 0.1, 0.0], [0.7, 0.2, 0.1], [0.0, 0.0, 1.0]], dtype=torch.float64)
    ours = jensen_shannon(p, q).numpy()
    # scipy returns the Jensen-Shannon *distance* (square root), natural log by default.
    theirs = np.array([jensenshannon(a, b) ** 2 for a, b in zip(p.numpy(), q.numpy(), strict=True)])
    np.testing.assert_allclose(ours, theirs, atol=1e-12)
    assert ours[1] == pytest.approx(0.0, abs=1e-12) and ours[2] == pytest.approx(math.log(2))


def test_peak_divergence_layer_by_hand():
    d = torch.tensor(
        [
            [0.10, 0.15, 0.60, 0.62],  # jumps 0.05, 0.45, 0.02 -> layer 3 (index 2)
            [0.50, 0.10, 0.12, 0.13],  # changes -0.40 (a fall is no increase), 0.02, 0.01 -> 2
            [0.20, 0.30, 0.40, 0.50],  # equal jumps -> the earliest, index 1
        ]
    )
    assert peak_divergence_layer(d).tolist() == [2, 2, 1]
    # Starting the search at layer 3 (1-based) skips the first jump.
    assert peak_divergence_layer(d, min_layer=3).tolist() == [2, 2, 2]


def test_inferential_stability_entropy_by_hand():
    probs = torch.tensor([[[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]]] * 2, dtype=torch.float64)
    ise = inferential_stability_entropy(probs, torch.tensor([1, 0]))
    assert ise[0].item() == pytest.approx(_h([0.25, 0.75]))  # mean of layers 2 and 3
    assert ise[1].item() == pytest.approx(_h([0.5, 0.5]))  # mean of all three


def test_daca_loss_divides_by_the_whole_batch():
    plm = torch.tensor([[2.0, 0.0, 0.0], [0.0, 3.0, 0.0]], dtype=torch.float64)
    polm = torch.tensor([[4.0, 1.0, 0.0], [5.0, 0.0, 1.0]], dtype=torch.float64)
    mask = agreement_mask(plm, polm)
    assert mask.tolist() == [True, False]
    p_g = plm.softmax(-1)
    t = 2.0
    q = torch.softmax(polm[0] / t, -1)
    expected = -(p_g[0] * q.log()).sum().item() / 2  # one agreeing sample, batch of two
    assert daca_loss(polm, p_g, mask, t).item() == pytest.approx(expected)


# Lens logits over two options whose softmax is (1, 0), (0, 1) or (1/2, 1/2) to within e^-60.
_A, _B, _U = [60.0, 0.0], [0.0, 60.0], [0.0, 0.0]


def test_divergence_weight_by_hand():
    # JSD((1, 0) || (1/2, 1/2)) = H((3/4, 1/4)) - (H((1, 0)) + H((1/2, 1/2))) / 2
    a = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - math.log(2) / 2  # ~0.2158
    b = math.log(2)  # JSD((1, 0) || (0, 1)), the maximum
    plm = torch.tensor(
        [
            [_U, _A, _A],  # d = [0, b, a]: changes b, a - b -> l* = 2nd layer (index 1)
            [_A, _A, _A],  # d = [a, b, a]: changes b - a, a - b -> index 1
            [_A, _U, _U],  # d = [b, 0, 0]: changes -b, 0 (never increases) -> index 2, w 0
            [_U, _U, _A],  # d = [0, 0, b]: changes 0, b -> index 2
        ],
        dtype=torch.float64,
    )
    polm = torch.tensor(
        [[_U, _B, _U], [_U, _B, _U], [_B, _U, _U], [_U, _U, _B]], dtype=torch.float64
    )
    d = layer_divergence(plm, polm)
    expected_d = [[0, b, a], [a, b, a], [b, 0, 0], [0, 0, b]]
    torch.testing.assert_close(d, torch.tensor(expected_d, dtype=torch.float64))
    peak = peak_divergence_layer(d)
    assert peak.tolist() == [1, 1, 2, 2]
    ln2 = math.log(2)
    expected = {
        "peak_jump": [b / ln2, (b - a) / ln2, 0.0, b / ln2],  # max(d_l* - d_(l*-1), 0) / ln 2
        "peak": [b / ln2, b / ln2, 0.0, b / ln2],  # d_l* / ln 2
        "final": [a / ln2, a / ln2, 0.0, b / ln2],  # d_L / ln 2
    }
    for weight, values in expected.items():
        got = divergence_weight(d, peak, weight)
        torch.testing.assert_close(
            got, torch.tensor(values, dtype=torch.float64), atol=1e-12, rtol=0
        )
        assert dual_align_targets(plm, polm, weight=weight).weight.tolist() == got.tolist()
    # The default is the jump; one layer has no jump before it, so it is taken from 0.
    default = dual_align_targets(plm, polm).weight
    torch.testing.assert_close(default, torch.tensor(expected["peak_jump"], dtype=torch.float64))
    one = divergence_weight(d[:, 2:], torch.zeros(4, dtype=torch.long))
    torch.testing.assert_close(one, torch.tensor([a, a, 0, b], dtype=torch.float64) / ln2)
    with pytest.raises(ValueError, match="weight='mean'"):
        divergence_weight(d, peak, "mean")


@pytest.mark.parametrize("weight", ["peak_jump", "peak", "final"])
def test_dual_align_loss_by_hand(weight):
    # Two samples, three layers, two options.
    plm = torch.tensor(
        [[[0.0, 0.0], [1.0, 0.0], [2.0, 0.0]], [[0.0, 1.0], [0.0, 0.5], [1.0, 0.0]]],
        dtype=torch.float64,
    )
    polm = torch.tensor(
        [[[0.0, 0.0], [3.0, 0.0], [5.0, 0.0]], [[0.0, 2.0], [1.0, 0.0], [0.0, 3.0]]],
        dtype=torch.float64,
    )
    targets = dual_align_targets(plm, polm, weight=weight)
    t = 1.7
    total = 0.0
    for i in range(2):
        pg = [plm[i, j].softmax(-1).numpy() for j in range(3)]
        pf = [polm[i, j].softmax(-1).numpy() for j in range(3)]
        d = [jensenshannon(pg[j], pf[j]) ** 2 for j in range(3)]
        peak = 1 if d[1] - d[0] >= d[2] - d[1] else 2  # the larger signed increase
        assert targets.peak_layer[i].item() == peak
        w = {
            "peak_jump": max(d[peak] - d[peak - 1], 0.0),
            "peak": d[peak],
            "final": d[2],
        }[weight] / math.log(2)
        pft = [torch.softmax(polm[i, j] / t, -1).numpy() for j in range(3)]
        kl = float((pg[2] * (np.log(pg[2]) - np.log(pft[2]))).sum())
        ise_g = _h(np.mean(pg[peak:], axis=0))
        ise_f = _h(np.mean(pft[peak:], axis=0))
        total += ((1 - w) * kl + w * (ise_g - ise_f) ** 2) / 2
    assert dual_align_loss(polm, targets, t).item() == pytest.approx(total, rel=1e-10)


def _scaled_pair(k: float, n: int = 600, layers: int = 6, options: int = 4, seed: int = 0):
    """PLM logits that sharpen with depth, and a PoLM whose every layer is k times sharper."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(n, 1, options, generator=generator, dtype=torch.float64)
    drift = 0.6 * torch.randn(n, layers, options, generator=generator, dtype=torch.float64)
    plm = (base + drift) * torch.linspace(0.3, 1.5, layers, dtype=torch.float64)[None, :, None]
    return plm, k * plm


@pytest.mark.parametrize("k", [0.5, 3.0])
def test_daca_and_dual_align_recover_the_known_temperature(k):
    plm, polm = _scaled_pair(k)
    p_g, mask = plm[:, -1].softmax(-1), agreement_mask(plm[:, -1], polm[:, -1])
    daca = fit_temperature_adam(
        lambda i, t: daca_loss(polm[i, -1], p_g[i], mask[i], t), len(plm), lr=0.1, epochs=60
    )
    targets = dual_align_targets(plm, polm)
    dual = fit_temperature_adam(
        lambda i, t: dual_align_loss(polm[i], _subset(targets, i), t), len(plm), epochs=60
    )
    assert daca.temperature == pytest.approx(k, rel=0.02)
    assert dual.temperature == pytest.approx(k, rel=0.02)
    assert dual.loss_after < dual.loss_before


def _subset(targets, index):
    from dataclasses import fields, replace

    return replace(targets, **{f.name: getattr(targets, f.name)[index] for f in fields(targets)})


def test_layer_divergence_needs_equal_depths():
    with pytest.raises(ValueError, match="same number of layers"):
        layer_divergence(torch.zeros(2, 3, 4), torch.zeros(2, 4, 4))


def _tiny(compose, overrides=()):
    from calm_lightning.models.loading import load_language_model

    cfg = compose(["model=tiny", *overrides, "paths.output_dir=/tmp/unused"])
    return load_language_model(cfg.model)


def test_logit_lens_final_layer_equals_the_models_own_logits(tiny_loaded):
    from calm_lightning.data.collate import pad_left

    tokenizer, lm = tiny_loaded.tokenizer, tiny_loaded.model
    texts = ("Which is right? A", "Short", "Another prompt here")
    rows = [tokenizer(t)["input_ids"] for t in texts]
    ids, mask = pad_left(rows, tokenizer.pad_token_id)
    options = torch.tensor([10, 200, 3000, 45])
    lens = lens_option_logits(lm, ids, mask, options, with_embeddings=True)
    assert lens.shape == (3, lm.config.num_hidden_layers + 1, 4)
    from calm_lightning.models.calibrated_lm import CalibratedLM

    own = CalibratedLM(lm).raw_logits(ids, mask, logits_to_keep=1)[:, -1, options]
    torch.testing.assert_close(lens[:, -1], own, rtol=1e-5, atol=1e-5)


def test_tiny_logit_scale_is_an_exact_temperature(tiny_loaded, compose):
    from calm_lightning.data.collate import pad_left

    scaled = _tiny(compose, ["model.logit_scale=3.0"]).model
    tokenizer = tiny_loaded.tokenizer
    ids, mask = pad_left([tokenizer("a question")["input_ids"]], tokenizer.pad_token_id)
    options = torch.tensor([1, 2, 3, 4])
    plm = lens_option_logits(tiny_loaded.model, ids, mask, options)
    polm = lens_option_logits(scaled, ids, mask, options)
    torch.testing.assert_close(polm, 3.0 * plm, rtol=1e-5, atol=1e-5)
