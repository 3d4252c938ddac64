"""Post-hoc calibrators of the Dual-Align paper, evaluated by the shared MCQA test loop.

* `DACA`, `DualAlign`: fit one temperature for the post-trained model (PoLM) on the setting's
  fit split (labels unused) against a pre-trained reference model (PLM), from the logit lens of
  both models (one forward each, cached per dataset); T is installed as the scalar head d = 1/T.
* `InternalConsistency`, `CAPE`, `Elicitation`: no temperature; they override
  `option_probabilities`, so metrics, result files and reports stay shared.

Methods whose confidence belongs to a stated answer (IC, elicitation) put that confidence c on
the answer and spread 1 - c evenly over the other options; the stated answer, not the argmax,
counts for accuracy, conf-ECE and MCE.
"""

from __future__ import annotations

import gc
import hashlib
import itertools
import json
import logging
import re
from dataclasses import fields, replace
from pathlib import Path

import torch
from omegaconf import DictConfig
from torch.utils.data import DataLoader

from calm_lightning.calibration.reference import (
    agreement_mask,
    daca_loss,
    dual_align_loss,
    dual_align_targets,
    fit_temperature_adam,
    inferential_stability_entropy,
)
from calm_lightning.calibration.semantic import UNIT_WORDS
from calm_lightning.data.collate import pad_left
from calm_lightning.data.prompts import OPTION_LETTERS, mcqa_user_text, render_prompt
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.mcqa import (
    OptionTokens,
    choose_option_tokens,
    option_token_candidates,
    score_options,
)
from calm_lightning.methods.base import CalibrationMethod
from calm_lightning.models.logit_lens import lens_option_logits

log = logging.getLogger(__name__)

LENS_CACHE_VERSION = 1


def check_reference_model(cfg: DictConfig) -> None:
    """Config-time refusal: a method that needs a PLM, and no `reference_model` is chosen."""
    requires = cfg.method.get("requires") or {}
    if requires.get("reference_model") and not cfg.get("reference_model"):
        raise ConfigError(
            f"method={cfg.method.name} calibrates against a pre-trained model and needs "
            "reference_model=<PLM of the same family as the model>, e.g. "
            "`model=llama31_8b_instruct reference_model=llama31_8b` or "
            "`model=qwen25_7b_instruct reference_model=qwen25_7b` (conf/reference_model/)"
        )


def stated_answer_probs(confidence: torch.Tensor, answer: torch.Tensor, k: int) -> torch.Tensor:
    """(B, K) rows with `confidence` on `answer` and the rest spread evenly over the others."""
    confidence = confidence.double().clamp(0.0, 1.0)
    probs = ((1 - confidence) / (k - 1))[:, None].repeat(1, k)
    probs[torch.arange(len(answer)), answer] = confidence
    return probs


# ----- DACA and Dual-Align: temperature fitted against the PLM -----


class ReferenceTemperature(CalibrationMethod):
    """Shared part of DACA and Dual-Align: the lens pass over the fit split, the cache, and
    installing T; subclasses define the loss."""

    trains = False
    posthoc = True

    def __init__(
        self,
        model,
        tokenizer=None,
        reference_model: dict | None = None,
        model_config: dict | None = None,
        cache_dir: str | None = None,
        use_cache: bool = True,
        lr: float = 0.05,
        epochs: int = 300,
        batch_size: int = 128,
        init_temperature: float = 1.0,
        parameterisation: str = "log",
        with_embeddings: bool = False,
        seed: int = 0,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        if not reference_model:
            raise ConfigError(f"{type(self).__name__} needs reference_model=<PLM>")
        if model.head is None or model.head.kind != "scalar":
            raise ConfigError(f"{type(self).__name__} needs a scalar head (method.head.kind)")
        self.reference_cfg = dict(reference_model)
        self.model_cfg = dict(model_config or {})
        polm_name = self.model_cfg.get("name")
        if polm_name and self.reference_cfg.get("pairs_with") not in (None, polm_name):
            log.warning(
                "reference_model=%s pairs with model=%s, but the model is %s",
                self.reference_cfg.get("name"),
                self.reference_cfg.get("pairs_with"),
                polm_name,
            )
        self.cache_dir = cache_dir
        self.use_cache = bool(use_cache)
        self.fit_options = {
            "lr": float(lr),
            "epochs": int(epochs),
            "batch_size": int(batch_size),
            "init": float(init_temperature),
            "parameterisation": parameterisation,
            "seed": int(seed),
        }
        self.with_embeddings = bool(with_embeddings)
        self._reference = None
        self._lens: dict | None = None
        self.fit_info: dict = {}

    # ----- the fit split and its cache -----
    def _cache_path(self, prompts: list[str], ids: list[str], max_length: int) -> Path:
        from calm_lightning.models.embedded import cache_root

        def identity(node: dict) -> dict:
            return {k: v for k, v in node.items() if k not in ("cache_dir", "name", "pairs_with")}

        digest = hashlib.sha256()
        header = {
            "version": LENS_CACHE_VERSION,
            "polm": identity(self.model_cfg),
            "plm": identity(self.reference_cfg),
            "option_tokens": self.option_token_style,
            "probe_size": self.probe_size,
            "with_embeddings": self.with_embeddings,
            "max_length": max_length,
        }
        digest.update(json.dumps(header, sort_keys=True, default=str).encode())
        for example_id, prompt in zip(ids, prompts, strict=True):
            digest.update(f"{example_id}\0{prompt}\0".encode())
        return cache_root(self.cache_dir) / "reference_lens" / f"{digest.hexdigest()[:24]}.pt"

    def posthoc_loader(self, datamodule) -> DataLoader:
        if datamodule.sources.get("heldout") is None:
            raise ConfigError(f"{type(self).__name__} needs a fit split (setting.heldout)")
        records = datamodule._load("heldout")
        if not records or not hasattr(records[0], "choices"):
            raise ConfigError(f"{type(self).__name__} fits on multiple-choice held-out data")
        self._records = {r.id: r for r in records}
        self._max_length = datamodule.eval_max_length
        prompts = [render_prompt(self.tokenizer, mcqa_user_text(r)) for r in records]
        self._cache_file = self._cache_path(prompts, [r.id for r in records], self._max_length)
        self._lens, self._cache_status = None, "off"
        if self.use_cache and self._cache_file.is_file():
            cached = torch.load(self._cache_file, weights_only=True)
            tokens = OptionTokens(cached["style"], tuple(cached["option_ids"]), cached["letters"])
            # The option spelling may already be fixed by the base evaluation; a cache made
            # with another spelling is not reused.
            if self.option_tokens in (None, tokens):
                self.option_tokens, self._lens = tokens, cached
                self._cache_status = "hit"
                log.info("logit-lens cache hit: %s", self._cache_file)
                return DataLoader([])
        loader = DataLoader(
            records, batch_size=datamodule.eval_batch_size, collate_fn=datamodule.test_collator
        )
        self._cache_status = "miss" if self.use_cache else "off"
        return loader

    def on_predict_start(self) -> None:
        self.model.eval()
        self._rows: dict[str, list] = {"ids": [], "polm": [], "plm": []}

    def _load_reference(self, n_options: int):
        from calm_lightning.models.loading import load_language_model

        loaded = load_language_model(self.reference_cfg)
        candidates = option_token_candidates(loaded.tokenizer, n_options)
        theirs = candidates.get(self.option_tokens.style)
        if theirs is None or theirs.ids != self.option_tokens.ids:
            raise ConfigError(
                f"the PoLM and reference_model={self.reference_cfg.get('name')} disagree on the "
                f"option tokens: PoLM {self.option_tokens.style!r} letters "
                f"{self.option_tokens.letters} are ids {list(self.option_tokens.ids)}, the PLM's "
                f"are {list(theirs.ids) if theirs else 'not single tokens'}. Pair models of one "
                "family (same tokenizer)."
            )
        loaded.model.to(self.device).eval()
        return loaded

    @torch.no_grad()
    def predict_step(self, batch: dict, batch_idx: int) -> None:
        if self.option_tokens is None:
            self.option_tokens = choose_option_tokens(
                self.model, self.tokenizer, batch, self.option_token_style, batch["n_options"]
            )
        if self._reference is None:
            self._reference = self._load_reference(batch["n_options"])
        options = self.option_tokens.tensor(self.device)
        polm = lens_option_logits(
            self.model.lm,
            batch["input_ids"],
            batch["attention_mask"],
            options,
            self.with_embeddings,
        )
        # The PLM reads the same prompt text (the PoLM's template), in its own tokenization.
        plm_tok = self._reference.tokenizer
        rows = []
        for example_id in batch["ids"]:
            text = render_prompt(self.tokenizer, mcqa_user_text(self._records[example_id]))
            # The rendered template carries its special tokens already (as in MCQACollator).
            encoded = plm_tok(text, add_special_tokens=False)["input_ids"]
            rows.append(encoded[-self._max_length :])
        ids, mask = pad_left(rows, plm_tok.pad_token_id)
        plm = lens_option_logits(
            self._reference.model,
            ids.to(self.device),
            mask.to(self.device),
            options,
            self.with_embeddings,
        )
        self._rows["ids"].extend(batch["ids"])
        self._rows["polm"].append(polm.cpu())
        self._rows["plm"].append(plm.cpu())

    def on_predict_end(self) -> None:
        if self._lens is not None:
            return
        if self._reference is not None:
            self._reference = None  # free the PLM before anything else runs
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._lens = {
            "ids": list(self._rows["ids"]),
            "polm": torch.cat(self._rows["polm"]),
            "plm": torch.cat(self._rows["plm"]),
            "style": self.option_tokens.style,
            "option_ids": list(self.option_tokens.ids),
            "letters": self.option_tokens.letters,
        }
        self._rows = {}
        if self.use_cache:
            self._cache_file.parent.mkdir(parents=True, exist_ok=True)
            partial = self._cache_file.with_suffix(".tmp")
            torch.save(self._lens, partial)
            partial.replace(self._cache_file)

    def fit_posthoc(self) -> dict:
        """Fit T on the cached lens logits and install d = 1 / T."""
        polm = self._lens["polm"].double()
        plm = self._lens["plm"].double()
        if polm.shape != plm.shape:
            raise ConfigError(
                f"PoLM and PLM lens shapes differ: {tuple(polm.shape)} vs {tuple(plm.shape)} "
                "(the two models must have the same number of layers)"
            )
        loss_fn, info = self.objective(polm, plm)
        fit = fit_temperature_adam(loss_fn, polm.shape[0], **self.fit_options)
        with torch.no_grad():
            self.model.head.scale.fill_(1.0 / fit.temperature)
            self.model.head.bias.zero_()
        self.fit_info = {
            "temperature": fit.temperature,
            "n": int(polm.shape[0]),
            "n_layers": int(polm.shape[1]),
            "loss_before": fit.loss_before,
            "loss_after": fit.loss_after,
            "steps": fit.steps,
            "lens_cache": self._cache_status,
            **info,
            **{f"fit_{k}": v for k, v in self.fit_options.items()},
        }
        log.info("%s: %s", type(self).__name__, self.fit_info)
        return self.fit_info

    def objective(self, polm: torch.Tensor, plm: torch.Tensor):
        """(loss_fn(index, T), extra info) for `fit_temperature_adam`."""
        raise NotImplementedError


class DACA(ReferenceTemperature):
    """Cross-entropy to the PLM's final distribution on agreement samples only."""

    def objective(self, polm, plm):
        polm_final, plm_probs = polm[:, -1], plm[:, -1].softmax(-1)
        mask = agreement_mask(plm[:, -1], polm_final)

        def loss_fn(index, temperature):
            return daca_loss(polm_final[index], plm_probs[index], mask[index], temperature)

        return loss_fn, {"agreement_rate": float(mask.double().mean())}


class DualAlign(ReferenceTemperature):
    """Divergence-weighted confidence + process (ISE) alignment to the PLM (reconstruction)."""

    def __init__(
        self,
        model,
        tokenizer=None,
        min_layer: int = 2,
        ise_tempered: str = "all",
        confidence_term: bool = True,
        process_term: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        if not (confidence_term or process_term):
            raise ConfigError("dual_align needs confidence_term or process_term (or both)")
        self.min_layer = int(min_layer)
        self.ise_tempered = ise_tempered
        self.components = (bool(confidence_term), bool(process_term))

    def objective(self, polm, plm):
        targets = dual_align_targets(plm, polm, self.min_layer)

        def loss_fn(index, temperature):
            part = replace(
                targets, **{f.name: getattr(targets, f.name)[index] for f in fields(targets)}
            )
            return dual_align_loss(
                polm[index], part, temperature, self.ise_tempered, self.components
            )

        peaks = torch.bincount(targets.peak_layer, minlength=polm.shape[1]).tolist()
        ise_f = inferential_stability_entropy(polm.softmax(-1), targets.peak_layer)
        info = {
            "agreement_rate": float(agreement_mask(plm[:, -1], polm[:, -1]).double().mean()),
            "mean_weight": float(targets.weight.mean()),
            "peak_layer_counts": peaks,
            "mean_ise_plm": float(targets.plm_ise.mean()),
            "mean_ise_polm_at_t1": float(ise_f.mean()),
            "min_layer": self.min_layer,
            "ise_tempered": self.ise_tempered,
            "components": list(self.components),
        }
        return loss_fn, info


# ----- confidences without a temperature -----


class _RecordsByIdMixin:
    """Gives a test step access to the records behind its batch (for re-prompting)."""

    def _index_test_records(self) -> None:
        self._records = {r.id: r for r in self.trainer.datamodule._load("test")}


class InternalConsistency(CalibrationMethod):
    """Confidence = share of lens layers whose top option equals the final layer's."""

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
        return stated_answer_probs(confidence, answer, lens.shape[-1]), answer


def option_orders(k: int, kind: str) -> list[tuple[int, ...]]:
    """The re-orderings CAPE averages over: `cyclic` (K rotations) or `all` (K! orders)."""
    if kind == "cyclic":
        return [tuple((i + s) % k for i in range(k)) for s in range(k)]
    if kind == "all":
        return list(itertools.permutations(range(k)))
    raise ConfigError(f"cape.permutations={kind!r} is not one of cyclic, all")


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

    def __init__(self, model, tokenizer=None, permutations: str = "cyclic", **evaluation) -> None:
        super().__init__(model, tokenizer, **evaluation)
        option_orders(4, permutations)  # validate early
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

        return permutation_average(records, score, self.permutations), None


# ----- verbalised confidence -----

ELICITATION_INSTRUCTION = (
    "Give the letter of the correct option and how confident you are that it is correct, "
    "as a percentage from 0 to 100. Reply exactly in this form:\n"
    "Answer: <letter>\nConfidence: <percentage>%"
)
_UNITS = {word: value for value, word in enumerate(UNIT_WORDS)}
_TENS = {
    w: 10 * (i + 2)
    for i, w in enumerate(
        ["twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
    )
}
# Qualitative answers, most specific first (documented in the README).
_LEVELS = (
    ("very high", 0.95),
    ("very low", 0.05),
    ("certain", 0.95),
    ("high", 0.8),
    ("medium", 0.5),
    ("moderate", 0.5),
    ("low", 0.2),
)


def _number_words(text: str) -> float | None:
    """The first spelled-out number (0..100) in `text`, e.g. "ninety-five" -> 95."""
    words = re.findall(r"[a-z]+", text.lower())
    for i, word in enumerate(words):
        if word not in _UNITS and word not in _TENS and word != "hundred":
            continue
        value, j = 0, i
        if words[j] == "one" and j + 1 < len(words) and words[j + 1] == "hundred":
            return 100.0
        if words[j] == "hundred":
            return 100.0
        if words[j] in _TENS:
            value = _TENS[words[j]]
            if j + 1 < len(words) and words[j + 1] in _UNITS and 0 < _UNITS[words[j + 1]] < 10:
                value += _UNITS[words[j + 1]]
        else:
            value = _UNITS[words[j]]
        return float(value)
    return None


def parse_confidence(text: str) -> float | None:
    """A verbalised confidence in [0, 1] from model output, or None if there is none.

    Reads the text after the last "confidence" when present. Accepted: "80%", "80 percent",
    "0.8", "80" (numbers above 1 are percentages), spelled-out numbers ("eighty percent"),
    and the levels very high / certain / high / medium / moderate / low / very low.
    """
    lowered = text.lower()
    at = lowered.rfind("confidence")
    segment = lowered[at + len("confidence") :] if at >= 0 else lowered
    percent = re.search(r"(\d+(?:\.\d+)?)\s*(?:%|percent)", segment)
    if percent:
        value = float(percent.group(1)) / 100
        return value if 0.0 <= value <= 1.0 else None
    number = re.search(r"(?<![\w.])(\d+(?:\.\d+)?|\.\d+)", segment)
    if number:
        value = float(number.group(1))
        value = value / 100 if value > 1 else value
        return value if 0.0 <= value <= 1.0 else None
    spelled = _number_words(segment)
    if spelled is not None:
        return spelled / 100 if spelled > 1 or "percent" in segment else spelled
    for level, value in _LEVELS:
        if re.search(rf"\b{level}\b", segment):
            return value
    return None


def parse_answer_letter(text: str, letters: str) -> int | None:
    """The option index a model names: "Answer: B", a line starting "B." / "(B)", or a lone
    option letter; None if there is none."""
    allowed = "".join(letters)
    patterns = (
        rf"answer\s*(?:is|:)?\s*\(?([{allowed}])\b",
        rf"(?m)^\s*\(?([{allowed}])[\).:]",
        rf"\b([{allowed}])\b",
    )
    for pattern in patterns:
        match = re.search(pattern, text, flags=re.IGNORECASE if pattern.startswith("answer") else 0)
        if match:
            return letters.index(match.group(1).upper())
    return None


class Elicitation(_RecordsByIdMixin, CalibrationMethod):
    """The PoLM states its answer letter and a confidence (greedy decoding)."""

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
        if fallback_confidence not in ("uniform", "model"):
            raise ConfigError("elicitation.fallback_confidence must be uniform or model")
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
        return stated_answer_probs(torch.tensor(confidences), answer, k), answer

    def on_test_epoch_end(self) -> None:
        super().on_test_epoch_end()
        self.predictions.extra = dict(self._stats)
        for row in self.generations[:3]:
            log.info("elicitation example: %s", row)
