"""GPU-only checks (4-bit QLoRA, bf16): skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_nf4_qlora_calm_step_trains_adapters_and_head(tmp_path):
    pytest.importorskip("bitsandbytes")
    import lightning as L

    from calm_lightning.data.datamodule import CalibrationDataModule
    from calm_lightning.data.sources import EmbeddedDemoSource
    from calm_lightning.methods.calm import CALM
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.loading import load_language_model
    from calm_lightning.models.logit_adjustment import LogitAdjustment
    from calm_lightning.models.lora import wrap_with_lora

    loaded = load_language_model(
        {"name": "smollm2", "source": "embedded", "dtype": "auto", "quantization": "nf4"}
    )
    assert loaded.quantized and loaded.dtype == torch.bfloat16
    lm = wrap_with_lora(loaded.model, {"r": 8, "lora_alpha": 16}, quantized=True)
    head = LogitAdjustment(lm.get_output_embeddings().weight.shape[0])
    module = CALM(
        CalibratedLM(lm, head), loaded.tokenizer, inner_steps=2, upper_lr=1e-3,
        inner_optimizer="adam", surrogate={"schedule": "per_step"},
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    datamodule = CalibrationDataModule(
        loaded.tokenizer,
        train=EmbeddedDemoSource("instruction", "train", limit=8),
        heldout=EmbeddedDemoSource("instruction", "heldout", limit=8),
        test=EmbeddedDemoSource("mcqa", "test", limit=16),
        batch_size=4,
    )
    trainer = L.Trainer(
        max_epochs=1,
        limit_train_batches=2,
        precision="bf16-mixed",
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
        accelerator="gpu",
        devices=1,
    )
    trainer.fit(module, datamodule=datamodule)
    changed = [
        n
        for n, p in module.named_parameters()
        if p.requires_grad and not torch.equal(before[n], p.detach())
    ]
    assert any("lora_B" in n for n in changed) and "model.head.scale" in changed
    trainer.test(module, datamodule=datamodule, verbose=False)
    assert module.predictions.probs.shape == (16, 4)
