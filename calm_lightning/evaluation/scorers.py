"""MCQA scoring as a component: how a multiple-choice question's options get logits.

Two implementations of one interface, chosen once from the config (`scorer_from_config`):

* `LetterScorer` (`evaluation.scoring=letter`, the CALM paper's protocol): the next-token
  logits of the option letters at the answer slot (evaluation/mcqa.py);
* `ClozeScorer` (`evaluation.scoring=cloze`, lm-eval-harness's way): each option text's
  log-likelihood as the continuation of the question (evaluation/cloze.py).

Methods, the training objectives, temperature fitting, the data module and the export ask the
scorer (its option tokens and option logits, the option distribution of a training batch, how
MCQA records train, how to fit a temperature on its distribution, its prompt format) instead of
testing a flag. Each call takes what it reads (the model, its tokenizer, a batch, the option
tokens, the longest prompt), never a method's module; the pipeline builds one scorer per run
and hands it to the data module and the method.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F

from calm_lightning.calibrators.temperature import BOUNDS, TemperatureFit, fit_temperature
from calm_lightning.config_rules import Number, OneOf, check_values
from calm_lightning.data.cloze_batches import PROMPTS, ClozeTrainingCollator
from calm_lightning.data.collate import select_response_logits
from calm_lightning.data.prompts import OPTION_LETTERS
from calm_lightning.evaluation.cloze import (
    NORMALIZE,
    ClozeScores,
    cloze_predictions,
    cloze_rows,
    score_cloze,
)
from calm_lightning.evaluation.mcqa import (
    STYLES,
    OptionTokens,
    answer_slot_rows,
    choose_option_tokens,
    score_options,
    training_letter_ids,
)

# Stands in for the letter tokens in the result files of a cloze evaluation.
CLOZE_OPTION_TOKENS = OptionTokens("cloze", (), OPTION_LETTERS)
# How a rendered prompt's ids start (data/tokens.py `encode_prompt`), for the export's record.
BOS_RULE = (
    "the tokenizer's bos_token_id first when encoding a text with its default special tokens "
    "puts it there and the rendered text does not already start with it"
)


class OptionPredictions(NamedTuple):
    """An MCQA training batch on the option distribution evaluation scores (differentiable)."""

    logits: torch.Tensor  # (B, K) adjusted option logits, fp32
    targets: torch.Tensor  # (B,) gold option index
    answer_ce: torch.Tensor | None = None  # the answer's cross-entropy, when asked or free
    answer_tokens: int = 0  # tokens answer_ce averages over (0 without it)


class MCQAScorer:
    """The interface. Arguments: `model` the CalibratedLM, `batch` a collated batch on the
    model's device, `option_tokens` the run's chosen option tokens, `max_length` the setting's
    longest MCQA prompt (the data module's `eval_max_length`; None: no limit)."""

    name: ClassVar[str]
    # Rules of the scorer's own config keys (under `evaluation`, or `evaluation.cloze`), the
    # ones the config check applies before any model loads.
    rules: ClassVar[dict] = {}
    # What `fit_on` records in metrics.json after a temperature fit on MCQA held-out data.
    fitted_on: ClassVar[str]
    # Whether the answer of an MCQA training example is one option of the option distribution
    # (the letter: a lower level's cross-entropy is the option distribution's) or a text whose
    # tokens a lower level trains over the vocabulary (cloze).
    answer_is_option: ClassVar[bool]
    # The option letters' spelling (letter targets of training objectives; `auto` asks the model).
    option_token_style: str = "auto"
    # How many test questions `select_option_tokens` reads to choose (0: it reads none).
    probe_size: int = 0
    # How an option's summed log-likelihood becomes its logit (cloze only; `none` = the sum).
    normalize: str = "none"

    @classmethod
    def from_config(cls, evaluation) -> MCQAScorer:
        """The scorer with the settings of an `evaluation` config block."""
        raise NotImplementedError

    def data_options(self) -> dict:
        """How MCQA records train and feed held-out objectives (the data module's arguments)."""
        raise NotImplementedError

    def select_option_tokens(self, model, tokenizer, probe: dict | None) -> OptionTokens:
        """The option tokens to score with (recorded in the result files), chosen on `probe`:
        the first `probe_size` test questions as one batch, or a held-out batch."""
        raise NotImplementedError

    def option_logits(
        self, model, tokenizer, batch: dict, option_tokens: OptionTokens, max_length=None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, K) option logits of a test batch under the calibrated model, and (cloze)
        lm-eval's acc_norm choice per question (None when the scorer has none)."""
        raise NotImplementedError

    def extra_metrics(self, chosen: torch.Tensor, gold: torch.Tensor) -> dict:
        """Metrics beyond the calibration report, from the side choices `option_logits` made."""
        return {}

    def training_option_ids(self, tokenizer) -> torch.Tensor | None:
        """The option letters' token ids as training targets spell them (None: not read)."""
        return None

    def training_logits(
        self, model, batch: dict, option_ids=None, params=None, answer_ce: bool = False
    ) -> OptionPredictions:
        """A training or held-out batch on this scorer's option distribution, with gradients
        (`params` as in `CalibratedLM.raw_logits`); `answer_ce` asks for the answer's
        cross-entropy from the same forward."""
        raise NotImplementedError

    def temperature_rows(
        self, model, tokenizer, batch: dict, option_tokens: OptionTokens, max_length=None
    ):
        """What a temperature fit keeps of one held-out batch (on the model's own logits)."""
        raise NotImplementedError

    def fit_temperature(self, rows: list, labels: torch.Tensor) -> TemperatureFit:
        """T minimising the NLL of this scorer's option distribution over the kept rows."""
        raise NotImplementedError

    def head_token_ids(self, tokenizer, records: list, option_tokens: OptionTokens) -> list[int]:
        """The token ids whose logits make this scorer's option scores on `records`: where a
        per-token head over the option distribution acts (vector scaling's O)."""
        raise NotImplementedError

    def head_rows(
        self, model, tokenizer, batch: dict, option_tokens: OptionTokens, token_ids, max_length=None
    ):
        """What a per-token head fit on `token_ids` keeps of one held-out batch (on the
        model's own logits): calibrators/vector_scaling.py `TokenRows`."""
        raise NotImplementedError

    def prompt_format(self, tokenizer, max_length: int) -> dict:
        """How a question is built and scored, spelled out for a user of an exported model."""
        raise NotImplementedError

    def score_question(self, model, tokenizer, question, options, option_tokens, max_length):
        """(K,) option logits of one question (an exported model's `option_probabilities`)."""
        raise NotImplementedError

    def describe(self, prompt: dict, option_tokens: dict | None) -> str:
        """One sentence for a model card: how answers were scored (`prompt` as recorded by
        `prompt_format`)."""
        raise NotImplementedError


class LetterScorer(MCQAScorer):
    name = "letter"
    fitted_on = "mcqa_calibration_half"
    answer_is_option = True
    rules = {"option_tokens": OneOf(STYLES), "probe_size": Number(minimum=1, integer=True)}

    def __init__(self, option_tokens: str = "auto", probe_size: int = 8) -> None:
        check_values(
            "evaluation", {"option_tokens": option_tokens, "probe_size": probe_size}, self.rules
        )
        self.option_token_style = option_tokens
        self.probe_size = int(probe_size)

    @classmethod
    def from_config(cls, evaluation) -> LetterScorer:
        return cls(evaluation.get("option_tokens", "auto"), evaluation.get("probe_size", 8))

    def data_options(self) -> dict:
        # MCQA records train as instruction examples answering with the option letter.
        return {"mcqa_collator": None}

    def select_option_tokens(self, model, tokenizer, probe: dict | None) -> OptionTokens:
        n_options = probe["n_options"] if probe else 4
        return choose_option_tokens(model, tokenizer, probe, self.option_token_style, n_options)

    def option_logits(self, model, tokenizer, batch, option_tokens, max_length=None):
        return score_options(model, batch, option_tokens).double(), None

    def training_option_ids(self, tokenizer) -> torch.Tensor:
        # The ids the training labels hold at the answer slot (the joint encoding of prompt +
        # answer letter), whatever spelling evaluation scores.
        return training_letter_ids(tokenizer).tensor()

    def training_logits(self, model, batch, option_ids=None, params=None, answer_ce=False):
        raw = model.raw_logits(batch["input_ids"], batch["attention_mask"], params=params)
        rows, targets = answer_slot_rows(raw, batch["labels"], option_ids)
        logits = model.adjust(rows, option_ids)
        if not answer_ce:
            return OptionPredictions(logits, targets)
        # The answer's cross-entropy: every response token's (the letter and what follows it)
        # next-token distribution through the head, from the same forward.
        selected, next_tokens = select_response_logits(raw, batch["labels"])
        ce = F.cross_entropy(model.adjust(selected).float(), next_tokens)
        return OptionPredictions(logits, targets, ce, next_tokens.numel())

    def temperature_rows(self, model, tokenizer, batch, option_tokens, max_length=None):
        return score_options(model, batch, option_tokens).cpu()

    def fit_temperature(self, rows: list, labels: torch.Tensor) -> TemperatureFit:
        return fit_temperature(torch.cat(rows), labels)

    def head_token_ids(self, tokenizer, records, option_tokens) -> list[int]:
        return list(option_tokens.ids)  # the K letters, in option order

    def head_rows(self, model, tokenizer, batch, option_tokens, token_ids, max_length=None):
        from calm_lightning.calibrators.vector_scaling import letter_rows

        return letter_rows(score_options(model, batch, option_tokens))

    def prompt_format(self, tokenizer, max_length: int) -> dict:
        from calm_lightning.data.prompts import MCQA_INSTRUCTION, PLAIN_SYSTEM

        chat = bool(getattr(tokenizer, "chat_template", None))
        return {
            "scoring": "letter",
            "user_text": "{question}\n\n{options}\n\n" + MCQA_INSTRUCTION,
            "options": "one line per option, '{letter}. {text}', joined by '\\n'",
            "letters": "the option letters but the last joined by ', ', then ' or ' and the "
            "last (A, B, C or D)",
            "template": "chat" if chat else "plain",
            "chat": "tokenizer.apply_chat_template([{'role': 'user', 'content': user_text}], "
            "tokenize=False, add_generation_prompt=True)",
            "plain": None if chat else "{bos}" + PLAIN_SYSTEM + " USER: {user_text} ASSISTANT:",
            "add_special_tokens": False,
            "bos": BOS_RULE,
            "scored_position": "the next token after the prompt (the answer slot)",
            "max_length": max_length,
        }

    def describe(self, prompt: dict, option_tokens: dict | None) -> str:
        tokens = option_tokens or {}
        template = "chat-templated" if prompt.get("template") == "chat" else "plain"
        return (
            "Multiple-choice answers were scored on the **option letters** "
            f"{tokens.get('letters', '')} spelled `{tokens.get('style')}` (token ids "
            f"{tokens.get('ids')}) at the answer slot of the {template} prompt described in "
            "`calibration.json` (`prompt`)."
        )

    def score_question(self, model, tokenizer, question, options, option_tokens, max_length):
        from calm_lightning.data.collate import MCQACollator
        from calm_lightning.data.records import MCQARecord

        record = MCQARecord(id="question", question=question, choices=tuple(options), answer=0)
        batch = MCQACollator(tokenizer, max_length=max_length or 1024)([record])
        device = next(model.parameters()).device
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return score_options(model, batch, option_tokens).double()[0]


class ClozeScorer(MCQAScorer):
    """`normalize`: how an option's summed log-likelihood becomes its logit (none = the sum);
    `prompt`: chat (question as the user turn, option as the start of the assistant turn) or
    plain (`Question: ...\\nAnswer:` then ` <option>`)."""

    name = "cloze"
    fitted_on = "mcqa_calibration_half_cloze"
    answer_is_option = False
    rules = {"normalize": OneOf(NORMALIZE), "prompt": OneOf(PROMPTS)}

    def __init__(self, normalize: str = "none", prompt: str = "chat") -> None:
        check_values("evaluation.cloze", {"normalize": normalize, "prompt": prompt}, self.rules)
        self.normalize, self.prompt = normalize, prompt

    @classmethod
    def from_config(cls, evaluation) -> ClozeScorer:
        cloze = evaluation.get("cloze") or {}
        return cls(**{key: cloze[key] for key in cls.rules if key in cloze})

    def data_options(self) -> dict:
        # MCQA records train with the answer text and all K option rows (cloze_batches.py).
        return {"mcqa_collator": self.training_collator}

    def training_collator(self, tokenizer, max_length: int) -> ClozeTrainingCollator:
        """The collator of cloze-format MCQA training (and held-out) batches."""
        return ClozeTrainingCollator(tokenizer, self.prompt, max_length)

    def select_option_tokens(self, model, tokenizer, probe: dict | None) -> OptionTokens:
        return CLOZE_OPTION_TOKENS

    def option_logits(self, model, tokenizer, batch, option_tokens, max_length=None):
        # `max_length` cuts a long prompt from the left, as letter scoring does.
        scores = score_cloze(
            model, tokenizer, batch["questions"], batch["choices"], self.prompt, max_length
        )
        return scores.logits(self.normalize), scores.acc_norm_predictions()

    def training_logits(self, model, batch, option_ids=None, params=None, answer_ce=False):
        # One forward of the B * K option rows gives the answer text's cross-entropy too.
        scored = cloze_predictions(model, batch, self.normalize, params)
        return OptionPredictions(
            scored.logits, scored.targets, scored.answer_ce, scored.answer_tokens
        )

    def extra_metrics(self, chosen: torch.Tensor, gold: torch.Tensor) -> dict:
        # lm-eval's acc_norm (argmax of log-likelihood per character), whatever normalize is.
        return {"acc_norm": float((chosen == gold).double().mean())}

    def temperature_rows(self, model, tokenizer, batch, option_tokens, max_length=None):
        from calm_lightning.evaluation.cloze_temperature import (
            temperature_scales,
            temperature_terms,
        )

        scores, lse = temperature_terms(
            model,
            tokenizer,
            batch["questions"],
            batch["choices"],
            temperature_scales(BOUNDS),
            self.prompt,
            max_length,
        )
        return scores, lse

    def fit_temperature(self, rows: list, labels: torch.Tensor) -> TemperatureFit:
        from calm_lightning.evaluation.cloze_temperature import (
            fit_cloze_temperature,
            temperature_scales,
        )

        scores = ClozeScores(
            *(torch.cat([getattr(s, f) for s, _ in rows]) for f in ClozeScores.FIELDS)
        )
        lse = torch.cat([t for _, t in rows])
        return fit_cloze_temperature(
            scores, lse, labels, temperature_scales(BOUNDS), self.normalize, BOUNDS
        )

    def head_token_ids(self, tokenizer, records, option_tokens) -> list[int]:
        from calm_lightning.data.cloze_batches import option_text_ids

        return option_text_ids(tokenizer, records, self.prompt)  # every option text's tokens

    def head_rows(self, model, tokenizer, batch, option_tokens, token_ids, max_length=None):
        return cloze_rows(
            model,
            tokenizer,
            batch["questions"],
            batch["choices"],
            token_ids,
            self.prompt,
            max_length,
            self.normalize,
        )

    def describe(self, prompt: dict, option_tokens: dict | None) -> str:
        template = "the chat template" if prompt.get("template") == "chat" else "a plain prompt"
        return (
            "Multiple-choice answers were scored by **cloze** (option likelihood, as lm-eval "
            f"does): each option text's log-likelihood after the question in {template} "
            f"({prompt.get('context')}), normalisation `{prompt.get('normalize')}`, then a "
            "softmax over the options; details in `calibration.json` (`prompt`)."
        )

    def prompt_format(self, tokenizer, max_length: int) -> dict:
        chat = self.prompt == "chat"
        return {
            "scoring": "cloze",
            "template": self.prompt,
            "context": "tokenizer.apply_chat_template([{'role': 'user', 'content': question}, "
            "{'role': 'assistant', 'content': option}], tokenize=False) cut where the option "
            "text starts"
            if chat
            else "'Question: {question}\nAnswer:'",
            "continuation": "'{option}'" if chat else "' {option}'",
            "option_score": "sum over the continuation tokens of log softmax(z') of each token "
            "(z' = the head applied to that position's logits), as lm-eval's loglikelihood",
            "normalize": self.normalize,
            "probabilities": "softmax over the options of the (normalized) option scores",
            "add_special_tokens": False,
            "bos": BOS_RULE,
            "max_length": max_length,
        }

    def score_question(self, model, tokenizer, question, options, option_tokens, max_length):
        scores = score_cloze(model, tokenizer, [question], [list(options)], self.prompt, max_length)
        return scores.logits(self.normalize)[0]


SCORERS = {"letter": LetterScorer, "cloze": ClozeScorer}
# Every scorer's rules, keyed under `evaluation` (the config check applies them all, whichever
# scorer is chosen).
SCORING_RULES = {
    "scoring": OneOf(tuple(SCORERS)),
    **LetterScorer.rules,
    **{f"cloze.{key}": rule for key, rule in ClozeScorer.rules.items()},
}


def scorer_from_config(evaluation) -> MCQAScorer:
    """The scorer an `evaluation` config block asks for (the one place that reads
    `evaluation.scoring`, `.cloze`, `.option_tokens` and `.probe_size`)."""
    evaluation = evaluation or {}
    name = evaluation.get("scoring", "letter")
    check_values("evaluation", {"scoring": name}, {"scoring": SCORING_RULES["scoring"]})
    return SCORERS[name].from_config(evaluation)


def scorer_from_prompt(prompt: dict) -> MCQAScorer:
    """The scorer an exported folder's recorded `prompt` (calibration.json) describes."""
    return scorer_from_config(
        {
            "scoring": prompt.get("scoring", "letter"),
            "cloze": {
                "normalize": prompt.get("normalize", "none"),
                "prompt": prompt.get("template", "chat"),
            },
        }
    )
