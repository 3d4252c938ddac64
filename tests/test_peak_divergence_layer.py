"""Dual-Align's peak divergence layer l* and its `peak_jump` weight: l* is the layer of the
largest *signed* increase d_l - d_(l-1) (a drop never outranks a rise), ties go to the earliest
layer, a profile that never increases gets the layer of its smallest fall and a weight of 0.
Every expected value below is worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from calm_lightning.calibrators.reference import (
    divergence_weight,
    dual_align_targets,
    layer_divergence,
    peak_divergence_layer,
)

LN2 = math.log(2)


def _d(*rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def test_a_large_drop_does_not_beat_the_largest_increase():
    # Changes (1-based layers 2..5): +0.1, +0.4, -0.45, +0.05. The largest |change| is the drop
    # 0.5 -> 0.05 at layer 4 (index 3); the largest increase is 0.1 -> 0.5 at layer 3 (index 2).
    d = _d([0.0, 0.1, 0.5, 0.05, 0.1])
    peak = peak_divergence_layer(d)
    assert peak.tolist() == [2]
    w = divergence_weight(d, peak, "peak_jump")
    assert w.item() == pytest.approx(0.4 / LN2, abs=1e-12)
    assert divergence_weight(d, peak, "peak").item() == pytest.approx(0.5 / LN2, abs=1e-12)


def test_a_profile_that_never_increases():
    # Changes -0.1, -0.3, -0.05: the argmax is the smallest fall, -0.05 at index 3; w = 0.
    falling = _d([0.6, 0.5, 0.2, 0.15])
    peak = peak_divergence_layer(falling)
    assert peak.tolist() == [3]
    assert divergence_weight(falling, peak, "peak_jump").tolist() == [0.0]
    # `peak` still reads d at l*: 0.15 / ln 2.
    assert divergence_weight(falling, peak, "peak").item() == pytest.approx(0.15 / LN2)
    # A flat profile: changes 0, 0 -> the earliest, index 1, w = 0.
    flat = _d([0.3, 0.3, 0.3])
    peak = peak_divergence_layer(flat)
    assert peak.tolist() == [1]
    assert divergence_weight(flat, peak, "peak_jump").tolist() == [0.0]


def test_ties_go_to_the_earliest_layer():
    # Dyadic values, so the tied changes are exactly equal in floating point.
    d = _d(
        [0.0, 0.25, 0.25, 0.5, 0.5],  # changes .25, 0, .25, 0 -> index 1
        [0.75, 0.5, 0.25, 0.0, 0.0],  # changes -.25, -.25, -.25, 0 -> index 4 (the only max)
        [0.625, 0.5, 0.375, 0.25, 0.125],  # changes -.125 four times -> the earliest, index 1
        [0.5, 0.25, 0.25, 0.25, 0.0],  # changes -.25, 0, 0, -.25 -> the earlier zero, index 2
    )
    assert peak_divergence_layer(d).tolist() == [1, 4, 1, 2]
    # From layer 3 (1-based) on, row 0's changes are 0, .25, 0 -> index 3.
    assert peak_divergence_layer(d, min_layer=3).tolist() == [3, 4, 2, 2]


def test_peak_jump_weight_is_the_signed_increase_at_l_star():
    # Searching from layer 3 on a profile that only falls there: changes -0.25 (index 2),
    # -0.125 (index 3) -> index 3; the signed increase is -0.125, so w = 0 (|.| would be 0.125).
    d = _d([0.0, 0.5, 0.25, 0.125])
    peak = peak_divergence_layer(d, min_layer=3)
    assert peak.tolist() == [3]
    assert divergence_weight(d, peak, "peak_jump").tolist() == [0.0]
    # Given an l* at a fall directly, the weight is clamped at 0 as well, not |d_l* - d_(l*-1)|.
    assert divergence_weight(d, torch.tensor([2]), "peak_jump").tolist() == [0.0]
    # At a rise it is (d_l* - d_(l*-1)) / ln 2: layer 2 (index 1), 0.5 / ln 2.
    w = divergence_weight(d, torch.tensor([1]), "peak_jump")
    assert w.item() == pytest.approx(0.5 / LN2, abs=1e-12)


def test_batched_profiles_are_handled_per_sample():
    d = _d(
        [0.0, 0.1, 0.5, 0.05, 0.1],  # largest increase +0.4 at index 2
        [0.6, 0.5, 0.2, 0.15, 0.0],  # changes -0.1, -0.3, -0.05, -0.15 -> index 3, w 0
        [0.0, 0.25, 0.25, 0.5, 0.5],  # tie .25 at indices 1 and 3 -> index 1
        [0.1, 0.0, 0.0, 0.0, 0.6],  # changes -0.1, 0, 0, +0.6 -> index 4
    )
    peak = peak_divergence_layer(d)
    assert peak.tolist() == [2, 3, 1, 4]
    w = divergence_weight(d, peak, "peak_jump")
    torch.testing.assert_close(w, _d(0.4, 0.0, 0.25, 0.6) / LN2, atol=1e-12, rtol=0)
    # Each row alone gives the same answer as in the batch.
    for i in range(len(d)):
        assert peak_divergence_layer(d[i : i + 1]).item() == peak[i].item()
        assert divergence_weight(d[i : i + 1], peak[i : i + 1]).item() == w[i].item()
    # Any leading shape works for l*: (2, 2, L).
    assert peak_divergence_layer(d.reshape(2, 2, 5)).tolist() == [[2, 3], [1, 4]]


# Lens logits over two options whose softmax is (1, 0), (0, 1) or (1/2, 1/2) to within e^-60.
_A, _B, _U = [60.0, 0.0], [0.0, 60.0], [0.0, 0.0]


def test_dual_align_targets_pick_the_increase_not_the_drop():
    a = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) - LN2 / 2  # JSD((1,0) || (1/2,1/2))
    b = LN2  # JSD((1, 0) || (0, 1))
    # d = [0, a, b, 0]: changes a (~0.216), b - a (~0.477), -b (~-0.693). The largest |change|
    # is the drop at index 3; the largest increase is b - a at index 2.
    plm = torch.tensor([[_U, _A, _A, _U]], dtype=torch.float64)
    polm = torch.tensor([[_U, _U, _B, _U]], dtype=torch.float64)
    d = layer_divergence(plm, polm)
    torch.testing.assert_close(d, _d([0.0, a, b, 0.0]), atol=1e-12, rtol=0)
    targets = dual_align_targets(plm, polm)
    assert targets.peak_layer.tolist() == [2]
    assert targets.weight.item() == pytest.approx((b - a) / LN2, abs=1e-12)
