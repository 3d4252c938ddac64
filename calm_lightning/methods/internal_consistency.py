"""Internal consistency (a comparison row of the Dual-Align paper): the confidence of the final
layer's stated answer is the share of logit-lens layers whose top option agrees with it."""

from __future__ import annotations

from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.evaluator import ScoredOptions
from calm_lightning.methods.base import CalibrationMethod, stated_answer_probs
from calm_lightning.models.logit_lens import lens_option_logits


class InternalConsistency(CalibrationMethod):
    """Confidence = share of lens layers whose top option equals the final layer's."""

    cloze_refusal = (
        "internal consistency reads the logit lens restricted to the option letters at the "
        "answer slot; a cloze option has no single position whose lens could vote"
    )

    def __init__(
        self,
        model,
        tokenizer=None,
        with_embeddings: bool = False,
        include_final: bool = False,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.with_embeddings = bool(with_embeddings)
        self.include_final = bool(include_final)

    def option_probabilities(self, batch):
        lens = lens_option_logits(
            self.model.lm,
            batch["input_ids"],
            batch["attention_mask"],
            self.option_tokens.tensor(self.device),
            self.with_embeddings,
        )
        answer = lens[:, -1].argmax(-1)
        layers = lens if self.include_final else lens[:, :-1]
        if layers.shape[1] == 0:
            raise ConfigError("internal consistency needs more than one lens layer")
        confidence = (layers.argmax(-1) == answer[:, None]).double().mean(1)
        return ScoredOptions(stated_answer_probs(confidence, answer, lens.shape[-1]), answer)
