"""Confidences from changing the prompt, without a fitted temperature (the Dual-Align paper's
comparison rows): `CAPE` (option probabilities averaged over option orders) and `Elicitation`
(the model states its answer and a verbalised confidence). Each overrides
`option_probabilities` only, so metrics and result files stay shared; internal consistency
(a logit-lens readout) is internal_consistency.py.

Elicitation's confidence belongs to a stated answer: `stated_answer_probs` (methods/base.py)
puts it on the answer and spreads the rest evenly; the stated answer, not the argmax, counts
for accuracy, conf-ECE and MCE.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from typing import ClassVar

import torch

from calm_lightning.config_rules import Number, OneOf
from calm_lightning.data.prompts import OPTION_LETTERS, mcqa_user_text, render_prompt
from calm_lightning.data.records import MCQARecord
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.evaluator import ScoredOptions
from calm_lightning.evaluation.mcqa import score_options
from calm_lightning.evaluation.verbalized import parse_answer_letter, parse_confidence
from calm_lightning.methods.base import CalibrationMethod, stated_answer_probs

log = logging.getLogger(__name__)


class _RecordsByIdMixin:
    """Gives a test step access to the records behind its batch (for re-prompting)."""

    def _index_test_records(self) -> None:
        # every loaded MCQA split: the held-out pass (evaluation/heldout_pass.py) scores the
        # calibration split through the same path
        loaded = self.trainer.datamodule.records
        self._records = {
            r.id: r for rows in loaded.values() for r in rows if isinstance(r, MCQARecord)
        }
        self._records.update({r.id: r for r in self.trainer.datamodule._load("test")})


def option_orders(k: int, kind: str) -> list[tuple[int, ...]]:
    """The re-orderings CAPE averages over: `cyclic` (K rotations) or `all` (K! orders)."""
    if kind == "cyclic":
        return [tuple((i + s) % k for i in range(k)) for s in range(k)]
    if kind == "all":
        return list(itertools.permutations(range(k)))
    raise ConfigError(f"method.module.permutations={kind!r} is not one of cyclic, all")


def permutation_average(records, score, kind: str = "cyclic") -> torch.Tensor:
    """CAPE: mean over re-orderings of the option probabilities, mapped back to the original
    options. `score(records)` returns (len(records), K) probabilities in each record's order."""
    k = len(records[0].choices)
    orders = option_orders(k, kind)
    shown = [
        replace(r, choices=tuple(r.choices[j] for j in order), answer=order.index(r.answer))
        for r in records
        for order in orders
    ]
    probs = score(shown).double().reshape(len(records), len(orders), k)
    back = torch.zeros(len(records), k, dtype=torch.float64)
    for o, order in enumerate(orders):
        # slot j of this order shows original option order[j]
        back[:, list(order)] += probs[:, o].cpu()
    return back / len(orders)


class CAPE(_RecordsByIdMixin, CalibrationMethod):
    """Option probabilities averaged over option re-orderings."""

    cloze_refusal = (
        "CAPE averages over option orders, and cloze scoring never shows the options in the "
        "prompt, so every order gives the same scores (CAPE would equal base)"
    )

    config_rules: ClassVar[dict] = {"permutations": OneOf(("cyclic", "all"))}

    def __init__(self, model, tokenizer=None, permutations: str = "cyclic", **evaluation) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(permutations=permutations)
        self.permutations = permutations

    def on_test_start(self) -> None:
        super().on_test_start()
        self._index_test_records()

    def option_probabilities(self, batch):
        collate = self.trainer.datamodule.test_collator
        records = [self._records[i] for i in batch["ids"]]
        chunk = max(1, len(records))

        def score(shown):
            out = []
            for start in range(0, len(shown), chunk):
                sub = collate(shown[start : start + chunk])
                ids = sub["input_ids"].to(self.device)
                mask = sub["attention_mask"].to(self.device)
                logits = score_options(
                    self.model, {"input_ids": ids, "attention_mask": mask}, self.option_tokens
                )
                out.append(torch.softmax(logits.double(), -1).cpu())
            return torch.cat(out)

        return ScoredOptions(permutation_average(records, score, self.permutations))


# ----- verbalised confidence -----

ELICITATION_INSTRUCTION = (
    "Give the letter of the correct option and how confident you are that it is correct, "
    "as a percentage from 0 to 100. Reply exactly in this form:\n"
    "Answer: <letter>\nConfidence: <percentage>%"
)


class Elicitation(_RecordsByIdMixin, CalibrationMethod):
    """The PoLM states its answer letter and a confidence (greedy decoding)."""

    config_rules: ClassVar[dict] = {
        "max_new_tokens": Number(minimum=1, integer=True),
        "batch_size": Number(minimum=1, integer=True),
        "fallback_confidence": OneOf(("uniform", "model")),
    }

    cloze_refusal = (
        "elicitation's confidence is the number the model writes, not a distribution scored "
        "over the options, so there is nothing for option likelihood to score"
    )

    def __init__(
        self,
        model,
        tokenizer=None,
        max_new_tokens: int = 24,
        batch_size: int = 8,
        fallback_confidence: str = "uniform",
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(
            max_new_tokens=max_new_tokens,
            batch_size=batch_size,
            fallback_confidence=fallback_confidence,
        )
        self.max_new_tokens = int(max_new_tokens)
        self.generation_batch_size = int(batch_size)
        self.fallback_confidence = fallback_confidence

    def on_test_start(self) -> None:
        super().on_test_start()
        self._index_test_records()
        self._stats = {"letter_parse_failures": 0, "confidence_parse_failures": 0}
        self.generations: list[dict] = []

    def option_probabilities(self, batch):
        from calm_lightning.evaluation.sampling import sample_answers

        records = [self._records[i] for i in batch["ids"]]
        prompts = [
            render_prompt(
                self.tokenizer,
                mcqa_user_text(r).rsplit("\n\n", 1)[0] + "\n\n" + ELICITATION_INSTRUCTION,
            )
            for r in records
        ]
        texts = sample_answers(
            self.model,
            self.tokenizer,
            prompts,
            n=1,
            max_new_tokens=self.max_new_tokens,
            temperature=0.0,
            stop_on_newline=False,
            batch_size=self.generation_batch_size,
        )
        scored = torch.softmax(score_options(self.model, batch, self.option_tokens).double(), -1)
        k = scored.shape[1]
        letters = OPTION_LETTERS[:k]
        answers, confidences = [], []
        for row, (text,) in enumerate(texts):
            answer = parse_answer_letter(text, letters)
            if answer is None:
                self._stats["letter_parse_failures"] += 1
                answer = int(scored[row].argmax())
            confidence = parse_confidence(text)
            if confidence is None:
                self._stats["confidence_parse_failures"] += 1
                confidence = (
                    1.0 / k if self.fallback_confidence == "uniform" else float(scored[row, answer])
                )
            answers.append(answer)
            confidences.append(confidence)
            self.generations.append(
                {"id": records[row].id, "text": text, "answer": answer, "confidence": confidence}
            )
        answer = torch.tensor(answers)
        return ScoredOptions(stated_answer_probs(torch.tensor(confidences), answer, k), answer)

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self.predictions.extra = dict(self._stats)
        for row in self.generations[:3]:
            log.info("elicitation example: %s", row)
