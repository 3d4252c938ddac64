"""A calibrated causal LM as transformers custom code, for heads the weights cannot carry.

`python -m calm_lightning.export` copies this file into an export folder as
`modeling_calibrated.py` (beside `logit_adjustment.py`, the head's own module), appends the two
lines that build `CalibratedForCausalLM` on the base architecture's class, and registers it in
`config.json` under `auto_map`. Then

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

returns a model whose `forward` gives the calibrated logits z' = d * (z - c) + l, so everything
built on `forward` (generate with greedy, sampling or beam search, pipelines, lm-eval's `hf`
model) sees the calibrated distribution without this project installed. Loaded without
`trust_remote_code`, the folder is the base architecture's ordinary checkpoint (the head's two
tensors are unused keys) and the model is the uncalibrated one.

Only torch, transformers and the head's module are imported: the file must run on its own.
"""

from __future__ import annotations

from calm_lightning.models.logit_adjustment import LogitAdjustment

HEAD_ATTRIBUTE = "calibration_head"  # the head's submodule: its tensors' prefix in the weights
CONFIG_KEY = "calibration_head"  # config.json: {"vocab_size", "kind", "center"}


def calibrated_class(base: type) -> type:
    """`base` (e.g. LlamaForCausalLM) with the calibration head applied to its logits."""

    class CalibratedForCausalLM(base):
        # The head's parameters are the calibration itself: fp32 whatever dtype loads the LM.
        _keep_in_fp32_modules = [
            *(getattr(base, "_keep_in_fp32_modules", None) or []),
            HEAD_ATTRIBUTE,
        ]

        def __init__(self, config) -> None:
            super().__init__(config)
            spec = getattr(config, CONFIG_KEY, None)
            if not spec:
                raise ValueError(
                    f"config has no {CONFIG_KEY!r} entry: this folder was not written by "
                    "`python -m calm_lightning.export` with a calibration head"
                )
            head = LogitAdjustment(
                int(spec["vocab_size"]), kind=spec["kind"], center=spec["center"]
            )
            setattr(self, HEAD_ATTRIBUTE, head.requires_grad_(False))

        def forward(self, *args, labels=None, **kwargs):
            """The base forward, its logits through the head (float32); with `labels`, the
            loss is the cross-entropy of the calibrated logits."""
            out = super().forward(*args, **kwargs)
            out.logits = getattr(self, HEAD_ATTRIBUTE)(out.logits)
            if labels is not None:
                out.loss = self.loss_function(
                    out.logits,
                    labels,
                    vocab_size=out.logits.shape[-1],
                    num_items_in_batch=kwargs.get("num_items_in_batch"),
                )
            return out

    name = f"Calibrated{base.__name__}"
    CalibratedForCausalLM.__name__ = CalibratedForCausalLM.__qualname__ = name
    return CalibratedForCausalLM
