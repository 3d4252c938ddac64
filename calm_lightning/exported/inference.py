"""`load_calibrated(folder)`: an exported calibrated model, ready to score multiple-choice
questions and to generate, through the same prompt and scoring code as a run's evaluation.

No Lightning or Hydra here either: the model loads with `AutoModelForCausalLM` (plus the PEFT
adapter of a `merge=false` export), the head is the folder's `CalibrationLogitsProcessor`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from calm_lightning.data.prompts import render_prompt
from calm_lightning.data.tokens import encode_prompt
from calm_lightning.evaluation.mcqa import OptionTokens, option_token_candidates
from calm_lightning.evaluation.scorers import scorer_from_prompt
from calm_lightning.models.calibrated_lm import ADAPTER_DIR, CalibratedLM
from calm_lightning.models.logits_processor import CalibrationLogitsProcessor, read_calibration


class CalibratedModel:
    """An exported model: `.model`, `.tokenizer`, `.processor` (the calibration head),
    `.calibration` (calibration.json), `option_probabilities` and `generate`."""

    def __init__(self, model, tokenizer, processor: CalibrationLogitsProcessor, calibration: dict):
        self.model = model
        self.tokenizer = tokenizer
        self.processor = processor
        self.calibration = calibration
        if processor.head is not None:
            processor.head.to(self.device)
        self._scorer = CalibratedLM(model, processor.head).eval()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def option_tokens(self, n_options: int) -> OptionTokens:
        """The option letters' token ids: the run's spelling ("A" or " A") for its letters."""
        recorded = self.calibration.get("option_tokens")
        if recorded and len(recorded["letters"]) == n_options:
            return OptionTokens(recorded["style"], tuple(recorded["ids"]), recorded["letters"])
        candidates = option_token_candidates(self.tokenizer, n_options)
        style = recorded["style"] if recorded else None
        return candidates.get(style) or next(iter(candidates.values()))

    @torch.no_grad()
    def option_probabilities(self, question: str, options: list[str]) -> list[float]:
        """Calibrated probabilities of the options, in their order, scored as the run scored
        them: the option letters' next-token logits after the chat-templated MCQA prompt, or
        (cloze runs) each option text's likelihood after the question; through the head, then
        a softmax."""
        prompt = self.calibration.get("prompt", {})
        logits = scorer_from_prompt(prompt).score_question(
            self._scorer,
            self.tokenizer,
            question,
            list(options),
            self.option_tokens(len(options)),
            prompt.get("max_length"),
        )
        return torch.softmax(logits.double(), dim=-1).tolist()

    @torch.no_grad()
    def generate(self, prompt: str, chat: bool = True, **generate_kwargs) -> str:
        """The model's answer to `prompt`, sampled (or greedy) from the calibrated distribution.

        `chat=True` wraps `prompt` as one user turn in the chat template (as evaluation does);
        `chat=False` continues the text as it is. Keyword arguments go to `model.generate`
        (`max_new_tokens` defaults to 64); the calibration head is the first logits processor
        (told it is handed log-probabilities when `num_beams` > 1).
        """
        from transformers import LogitsProcessorList

        if chat:  # as evaluation feeds it: BOS where the model takes one (data/tokens.py)
            ids = torch.tensor(
                [encode_prompt(self.tokenizer, render_prompt(self.tokenizer, prompt))]
            )
            encoded = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            encoded = dict(self.tokenizer(prompt, return_tensors="pt"))
        encoded = {k: v.to(self.device) for k, v in encoded.items()}
        generate_kwargs.setdefault("max_new_tokens", 64)
        generate_kwargs.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        processor = self.processor
        if int(generate_kwargs.get("num_beams") or 1) > 1:  # beam search: log-probabilities
            processor = CalibrationLogitsProcessor(processor.head, scores="log_probs")
        processors = LogitsProcessorList(
            [processor, *(generate_kwargs.pop("logits_processor", None) or [])]
        )
        out = self.model.generate(**encoded, logits_processor=processors, **generate_kwargs)
        new = out[0, encoded["input_ids"].shape[1] :]
        return self.tokenizer.decode(new, skip_special_tokens=True)


def load_calibrated(
    folder: str | Path, device: str | torch.device | None = None, dtype="auto"
) -> CalibratedModel:
    """Load a folder written by `python -m calm_lightning.export`.

    `device`: where the model goes (default: CUDA when available, else CPU); `dtype`: as
    `from_pretrained` takes it (`"auto"` = the dtype the folder was saved in).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(folder)
    calibration = read_calibration(folder)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    if (folder / ADAPTER_DIR).is_dir():  # merge=false: the base at the root + the adapter
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, folder / ADAPTER_DIR)
    model = model.to(device).eval()
    processor = CalibrationLogitsProcessor.from_pretrained(folder)
    return CalibratedModel(model, tokenizer, processor, calibration)
