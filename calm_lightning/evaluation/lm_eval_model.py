"""`CalibratedHFLM`: lm-eval-harness's own Hugging Face model (`HFLM`) scoring through a
`CalibratedLM`, so every lm-eval task sees exactly the model a run produced.

Only two hooks change: `_model_call` (the logits of every position, hence of every scored
continuation token, go through the logit-adjustment head or fitted temperature) and
`_model_generate` (the head is the first logits processor, as in an exported model). The
adapters need nothing: `HFLM` calls the (PEFT-wrapped) LM itself. Tokenization, batching,
request ordering, continuation selection and the log-softmax stay lm-eval's.

This module imports lm_eval at the top; import it only when retention runs.
"""

from __future__ import annotations

import logging

import torch
from lm_eval.models.huggingface import HFLM

from calm_lightning.models.calibrated_lm import CalibratedLM


class CalibratedHFLM(HFLM):
    """lm-eval's `HFLM` on a `CalibratedLM`: adapters through the LM, the head on the logits."""

    def __init__(
        self,
        calibrated: CalibratedLM,
        tokenizer,
        batch_size: int = 8,
        max_length: int | None = None,
        **kwargs,
    ) -> None:
        self.calibrated = calibrated
        # HFLM warns that a model object (not a name) was passed; that is the point here.
        hf_log = logging.getLogger("lm_eval.models.huggingface")
        level = hf_log.level
        hf_log.setLevel(logging.ERROR)
        try:
            super().__init__(
                pretrained=calibrated.lm,
                tokenizer=tokenizer,
                backend="causal",
                batch_size=batch_size,
                max_length=max_length,
                **kwargs,
            )
        finally:
            hf_log.setLevel(level)

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        """lm-eval's forward, then the head on the logits of every position (fp32)."""
        logits = super()._model_call(inps, attn_mask, labels)
        # lm-eval's own call runs under no_grad; the head must too, or its trainable d and l
        # would keep a (batch, length, vocabulary) graph alive.
        with torch.no_grad():
            return self.calibrated.adjust(logits)

    def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
        """lm-eval's generation with the head as the first logits processor."""
        head = self.calibrated.head
        if head is None:
            return super()._model_generate(context, max_length, stop, **generation_kwargs)
        from transformers import LogitsProcessorList

        from calm_lightning.models.logits_processor import CalibrationLogitsProcessor

        # The processor freezes the head it is given (meant for exported models); a head
        # borrowed from a live method gets its training flags back afterwards.
        flags = [(p, p.requires_grad) for p in head.parameters()]
        beams = int(generation_kwargs.get("num_beams") or 1) > 1  # beams hand over log-probs
        scores = "log_probs" if beams else "logits"
        was_training = head.training
        processors = LogitsProcessorList(
            [
                CalibrationLogitsProcessor(head, scores=scores),
                *(generation_kwargs.pop("logits_processor", None) or []),
            ]
        )
        try:
            return super()._model_generate(
                context, max_length, stop, logits_processor=processors, **generation_kwargs
            )
        finally:
            for param, flag in flags:
                param.requires_grad_(flag)
            head.train(was_training)

    def get_model_info(self) -> dict:
        """What was evaluated, without lm-eval's Hub look-up of a model SHA (no network)."""
        head = self.calibrated.head
        return {
            "model_num_parameters": sum(p.numel() for p in self.calibrated.lm.parameters()),
            "model_dtype": str(next(self.calibrated.lm.parameters()).dtype),
            "adapter": hasattr(self.calibrated.lm, "peft_config"),
            "head": None if head is None else {"kind": head.kind, "center": head.center},
        }
