"""The logit-adjustment head: identity at init, temperature scaling as a special case,
column selection, and save / load round trips."""

from __future__ import annotations

import pytest
import torch

from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import wrap_with_lora


@pytest.mark.parametrize("kind", ["vector", "scalar"])
@pytest.mark.parametrize("center", ["none", "logsumexp", "mean"])
def test_identity_at_init_gives_the_same_distribution(kind, center):
    z = torch.randn(3, 5, 11) * 7
    head = LogitAdjustment(11, kind=kind, center=center)
    adjusted = head(z)
    torch.testing.assert_close(torch.softmax(adjusted, -1), torch.softmax(z, -1))
    if center == "none":
        torch.testing.assert_close(adjusted, z)


def test_scalar_head_is_temperature_scaling():
    z = torch.randn(6, 4) * 5
    head = LogitAdjustment(4, kind="scalar")
    temperature = 2.5
    with torch.no_grad():
        head.scale.fill_(1 / temperature)
        head.bias.fill_(0.7)  # a shared bias cancels in the softmax
    expected = torch.softmax(z / temperature, -1)
    torch.testing.assert_close(torch.softmax(head(z), -1), expected)
    # The argmax (the prediction) is unchanged by a positive scalar d.
    assert torch.equal(head(z).argmax(-1), z.argmax(-1))


def test_vector_head_matches_the_formula_and_column_selection():
    torch.manual_seed(0)
    z = torch.randn(2, 3, 9) * 10
    head = LogitAdjustment(9, kind="vector", center="logsumexp")
    with torch.no_grad():
        head.scale.uniform_(0.5, 1.5)
        head.bias.normal_()
    c = torch.logsumexp(z, -1, keepdim=True)
    expected = head.scale * (z - c) + head.bias
    torch.testing.assert_close(head(z), expected)
    cols = torch.tensor([7, 1, 4])
    torch.testing.assert_close(head(z, cols), expected[..., cols])


def test_vocabulary_mismatch_is_an_error():
    with pytest.raises(ValueError, match="vocabulary mismatch"):
        LogitAdjustment(10)(torch.zeros(2, 11))


def test_head_save_and_load_is_bit_identical(tmp_path):
    head = LogitAdjustment(50, kind="vector", center="mean")
    with torch.no_grad():
        head.scale.normal_()
        head.bias.normal_()
    head.save(tmp_path)
    again = LogitAdjustment.load(tmp_path)
    assert (again.kind, again.center, again.vocab_size) == ("vector", "mean", 50)
    assert torch.equal(again.scale, head.scale) and torch.equal(again.bias, head.bias)


def test_calibrated_lm_round_trip_with_adapter_and_head(tmp_path, tiny_loaded):
    import copy

    base = copy.deepcopy(tiny_loaded.model)
    lm = wrap_with_lora(copy.deepcopy(base), {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0})
    with torch.no_grad():
        for name, param in lm.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.05)  # make the adapter do something
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0])
    with torch.no_grad():
        head.scale.uniform_(0.8, 1.2)
        head.bias.normal_(std=0.1)
    model = CalibratedLM(lm, head).eval()
    ids = torch.randint(0, 1000, (2, 7))
    mask = torch.ones_like(ids)
    expected = model(ids, mask)
    plain = CalibratedLM(copy.deepcopy(base)).eval()(ids, mask)
    model.save(tmp_path / "calib")
    assert (tmp_path / "calib" / "adapter" / "adapter_model.safetensors").is_file()
    loaded = CalibratedLM.load(base, tmp_path / "calib").eval()
    assert torch.equal(loaded(ids, mask), expected)
    # Adapter and head changed the outputs, so the round trip really restored them.
    assert not torch.allclose(plain, expected, atol=1e-3)
