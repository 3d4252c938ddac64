"""Post-hoc baselines that act per option or per token, where one temperature cannot
(docs/posthoc.md, "Per-token baselines"):

* `cc` / `cc_ts`: contextual calibration (Zhao et al. 2021): each question's option
  probabilities divided by those of content-free inputs, renormalised; `cc_ts` then a
  temperature on the corrected option logits, fitted on the calibration split.
* `bc`: batch calibration (Zhou et al. 2023): the option probabilities divided by their mean
  over an unlabeled batch (the test split itself by default, as the paper does).
* `vs`: vector scaling restricted to the option tokens (Guo et al. 2017), with an L2 pull
  toward the identity (Kull et al. 2019): a per-token head d_v, l_v fitted on the calibration
  split.
* `oracle`: the exact inverse of `model.logit_scale` and `model.logit_distortion` as a
  per-token head: the clean model back (a check of the distortion and of the head).

All work on the model's own logits (head off during their passes), under letter and cloze
scoring; the base row is the model as loaded.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch.utils.data import DataLoader

from calm_lightning.calibrators.temperature import fit_temperature
from calm_lightning.calibrators.vector_scaling import concat, fit_vector_scaling
from calm_lightning.config_rules import Flag, ListOf, Number, OneOf, Text
from calm_lightning.data.records import MCQARecord
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.evaluator import ScoredOptions
from calm_lightning.methods.base import HEAD_VECTOR, CalibrationMethod
from calm_lightning.models.logit_distortion import installed_distortion
from calm_lightning.runtime.distributed import gather_objects

log = logging.getLogger(__name__)


class PosthocOptions(CalibrationMethod):
    """A post-hoc fit on the option distribution: one predict pass over `fit_records` (the
    model's own logits, head off) keeps `collect(batch)` of each batch; `fit(collected)`
    fits, installs and returns what metrics.json keeps (`posthoc`)."""

    changes_model = True
    scorers = ("letter", "cloze")
    # Splits whose records must be multiple-choice (checked before any model loads).
    mcqa_splits: ClassVar[tuple[str, ...]] = ("test",)

    @classmethod
    def check_requirements(cls, cfg, sources: dict) -> None:
        super().check_requirements(cfg, sources)
        for split in cls.fitted_splits(cfg):
            kind = getattr(sources.get(split), "kind", None)
            if kind != "mcqa":
                raise ConfigError(
                    f"method={cfg.method.name} reads the {split} split's multiple-choice "
                    f"questions; setting={cfg.setting.name} has {kind or 'no'} {split} data: "
                    f"use a setting with MCQA {split} data (e.g. setting=demo_id)"
                )

    @classmethod
    def fitted_splits(cls, cfg) -> tuple[str, ...]:
        """The splits whose questions the method reads."""
        return cls.mcqa_splits

    def fit_records(self, datamodule) -> list:
        """The records the predict pass scores (none: no pass)."""
        return []

    def collect(self, batch: dict):
        """What the fit keeps of one batch (CPU objects)."""
        raise NotImplementedError

    def fit(self, collected: list) -> dict:
        """Fit on every process's collected items, install, return the record."""
        raise NotImplementedError

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        self._collate = datamodule.test_collator
        self._records = self.fit_records(datamodule)
        self._collected: list = []
        if self._records:
            loader = DataLoader(
                self._records,
                batch_size=datamodule.eval_batch_size,
                collate_fn=datamodule.test_collator,
            )
            trainer.predict(self, dataloaders=loader, return_predictions=False)
        collected = [item for rank in gather_objects(self._collected) for item in rank]
        self._collected = []
        fitted = self.fit(collected)
        log.info("%s: %s", type(self).__name__, {k: v for k, v in fitted.items() if k != "head"})
        return {"posthoc": fitted}

    def on_predict_start(self) -> None:
        self.model.eval()

    @torch.no_grad()
    def predict_step(self, batch: dict, batch_idx: int) -> None:
        head = self.model.head
        self.model.head = None  # the model's own logits
        try:
            if self.option_tokens is None:  # no base row scored yet: choose them here
                self.option_tokens = self.scorer.select_option_tokens(
                    self.model, self.tokenizer, batch
                )
            self._collected.append(self.collect(batch))
        finally:
            self.model.head = head

    def scored_logits(self, batch: dict) -> torch.Tensor:
        """(B, K) option logits of a batch under the model as it is, float64 on the CPU."""
        logits, _ = self.scorer.option_logits(
            self.model, self.tokenizer, batch, self.option_tokens, self.eval_max_length
        )
        return logits.double().cpu()


def calibration_half(datamodule, fraction: float) -> list:
    """The leading `fraction` of the held-out MCQA records: the calibration split ts fits on."""
    records = datamodule._load("heldout")
    return records[: max(1, int(len(records) * fraction))]


def corrected_logits(probs: torch.Tensor, prior: torch.Tensor) -> torch.Tensor:
    """log(p / prior) per option: softmax of it is p / prior renormalised."""
    return torch.log(probs) - torch.log(prior)


class ContextualCalibration(PosthocOptions):
    """Contextual calibration: option probabilities divided by a content-free input's.

    For each test question, p_cf is the mean over the `content_free` texts of the option
    probabilities with the text in place of the question (cloze: the question's own option
    texts are the labels and stay; letter: the letters are the labels, so the option texts
    become the content-free text too). Test probabilities p become p / p_cf renormalised
    (W = diag(p_cf)^-1). With `temperature`, a T on the corrected option logits log(p / p_cf)
    is fitted on the calibration split (the first `calibration_fraction` of held-out)."""

    config_rules: ClassVar[dict] = {
        "content_free": ListOf(Text(empty=True), nonempty=True),
        "temperature": Flag(),
        "calibration_fraction": Number(minimum=0, maximum=1, exclusive_minimum=True),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        content_free: list | tuple = ("N/A", "", "[MASK]"),
        temperature: bool = False,
        calibration_fraction: float = 0.5,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        content_free = list(content_free)
        self.check_arguments(
            content_free=content_free,
            temperature=temperature,
            calibration_fraction=calibration_fraction,
        )
        self.content_free = tuple(content_free)
        self.temperature = bool(temperature)
        self.calibration_fraction = float(calibration_fraction)
        self.fitted_temperature = 1.0
        self.p_cf: dict[str, torch.Tensor] = {}  # question id -> (K,) content-free probs

    @classmethod
    def fitted_splits(cls, cfg) -> tuple[str, ...]:
        uses_heldout = bool(cfg.method.module.get("temperature", False))
        return ("test", "heldout") if uses_heldout else ("test",)

    def fit_records(self, datamodule) -> list:
        records = list(datamodule._load("test"))
        if self.temperature:
            if datamodule.sources.get("heldout") is None:
                raise ConfigError("method=cc_ts needs held-out MCQA data (setting.heldout)")
            self._calibration = calibration_half(datamodule, self.calibration_fraction)
            records += self._calibration
        return records

    def content_free_probs(self, batch: dict) -> torch.Tensor:
        """(B, K) mean option probabilities of the content-free inputs of a batch."""
        letters_are_labels = self.scorer.answer_is_option
        total = None
        for j, text in enumerate(self.content_free):
            records = [
                MCQARecord(
                    id=f"{qid}#cf{j}",
                    question=text,
                    choices=(text,) * len(choices) if letters_are_labels else tuple(choices),
                    answer=0,
                )
                for qid, choices in zip(batch["ids"], batch["choices"], strict=True)
            ]
            cf = self._collate(records)
            cf = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in cf.items()}
            probs = torch.softmax(self.scored_logits(cf), dim=-1)
            total = probs if total is None else total + probs
        return total / len(self.content_free)

    def collect(self, batch: dict):
        probs = torch.softmax(self.scored_logits(batch), dim=-1)
        return list(batch["ids"]), probs, self.content_free_probs(batch), batch["labels"].cpu()

    def fit(self, collected: list) -> dict:
        for ids, _, p_cf, _ in collected:
            self.p_cf.update(zip(ids, p_cf, strict=True))
        mean = torch.stack(list(self.p_cf.values())).mean(0)
        info = {"content_free": list(self.content_free), "p_cf_mean": mean.tolist()}
        info["n_questions"] = len(self.p_cf)
        if self.temperature:
            wanted = {r.id for r in self._calibration}
            rows, labels, seen = [], [], set()
            for ids, probs, p_cf, y in collected:
                for i, qid in enumerate(ids):
                    if qid in wanted and qid not in seen:
                        seen.add(qid)
                        rows.append(corrected_logits(probs[i], p_cf[i]))
                        labels.append(int(y[i]))
            fit = fit_temperature(torch.stack(rows), torch.tensor(labels))
            self.fitted_temperature = fit.temperature
            info.update(
                temperature=fit.temperature,
                fitted_on="mcqa_calibration_half_corrected",
                n=fit.n,
                nll_before=fit.nll_before,
                nll_after=fit.nll_after,
                at_bound=fit.at_bound,
            )
        return info

    def option_probabilities(self, batch: dict) -> ScoredOptions:
        scored = super().option_probabilities(batch)
        if not self.p_cf:  # before calibration (the base row): the model as it is
            return scored
        if any(qid not in self.p_cf for qid in batch["ids"]):
            # questions the fit did not score (the held-out pass): their own content-free
            # probabilities, as every test question has
            self.p_cf.update(zip(batch["ids"], self.content_free_probs(batch), strict=True))
        p_cf = torch.stack([self.p_cf[qid] for qid in batch["ids"]]).to(scored.probs)
        logits = corrected_logits(scored.probs, p_cf) / self.fitted_temperature
        return ScoredOptions(torch.softmax(logits, dim=-1), side=scored.side)


class BatchCalibration(PosthocOptions):
    """Batch calibration: option probabilities divided by their mean over an unlabeled batch.

    The contextual prior p_bar (per option position) is the mean option probability over the
    `prior_split` questions, labels never read: `test` (the paper's choice: the test inputs
    themselves, transductive, one batch of the whole split) or `heldout` (all held-out
    questions: nothing of the test split is seen before scoring it). Test probabilities p
    become p / p_bar renormalised."""

    config_rules: ClassVar[dict] = {"prior_split": OneOf(("test", "heldout"))}

    def __init__(self, model, tokenizer=None, prior_split: str = "test", **evaluation) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(prior_split=prior_split)
        self.prior_split = prior_split
        self.prior: torch.Tensor | None = None

    @classmethod
    def fitted_splits(cls, cfg) -> tuple[str, ...]:
        split = cfg.method.module.get("prior_split", "test")
        return ("test",) if split == "test" else ("test", split)

    def fit_records(self, datamodule) -> list:
        if datamodule.sources.get(self.prior_split) is None:
            raise ConfigError(f"method=bc: this setting has no {self.prior_split} split")
        return list(datamodule._load(self.prior_split))

    def collect(self, batch: dict):
        return torch.softmax(self.scored_logits(batch), dim=-1)

    def fit(self, collected: list) -> dict:
        probs = torch.cat(collected)
        self.prior = probs.mean(0)
        return {
            "prior": self.prior.tolist(),
            "fitted_on": f"{self.prior_split}_unlabeled",
            "n": int(probs.shape[0]),
        }

    def option_probabilities(self, batch: dict) -> ScoredOptions:
        scored = super().option_probabilities(batch)
        if self.prior is None:  # the base row
            return scored
        logits = corrected_logits(scored.probs, self.prior.to(scored.probs))
        return ScoredOptions(torch.softmax(logits, dim=-1), side=scored.side)


def head_record(head, token_ids: list[int]) -> dict:
    """A vector head's entries on `token_ids`, for metrics.json."""
    return {
        "token_ids": list(token_ids),
        "scale": head.scale.detach()[token_ids].tolist(),
        "bias": head.bias.detach()[token_ids].tolist(),
    }


class VectorScaling(PosthocOptions):
    """Vector scaling on the option tokens: z'_v = d_v z_v + l_v for v in O, fitted on the
    calibration split (calibrators/vector_scaling.py). O is the letters (letter scoring) or
    every token id of the calibration split's option texts (cloze: the head acts on each
    continuation token's logits before the log-softmax and the sum over the option's tokens,
    as evaluation scores it); ids outside O keep d = 1, l = 0."""

    head = HEAD_VECTOR
    needs_heldout = True
    mcqa_splits = ("test", "heldout")
    config_rules: ClassVar[dict] = {
        "l2": Number(minimum=0),
        "calibration_fraction": Number(minimum=0, maximum=1, exclusive_minimum=True),
        "max_iter": Number(minimum=1, integer=True),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        l2: float = 0.01,
        calibration_fraction: float = 0.5,
        max_iter: int = 500,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(l2=l2, calibration_fraction=calibration_fraction, max_iter=max_iter)
        self.l2, self.max_iter = float(l2), int(max_iter)
        self.calibration_fraction = float(calibration_fraction)
        self.token_ids: list[int] | None = None

    def fit_records(self, datamodule) -> list:
        self.token_ids = None
        return calibration_half(datamodule, self.calibration_fraction)

    def collect(self, batch: dict):
        if self.token_ids is None:  # O: chosen once, from every calibration record
            self.token_ids = self.scorer.head_token_ids(
                self.tokenizer, self._records, self.option_tokens
            )
        rows = self.scorer.head_rows(
            self.model,
            self.tokenizer,
            batch,
            self.option_tokens,
            torch.tensor(self.token_ids, dtype=torch.long),
            self.eval_max_length,
        )
        return rows, batch["labels"].cpu()

    def fit(self, collected: list) -> dict:
        rows = concat([r for r, _ in collected])
        labels = torch.cat([y for _, y in collected])
        fit = fit_vector_scaling(rows, labels, self.l2, self.max_iter)
        head = self.model.head
        ids = torch.tensor(self.token_ids, dtype=torch.long, device=head.bias.device)
        with torch.no_grad():
            head.scale.index_copy_(0, ids, fit.scale.to(head.bias))
            head.bias.index_copy_(0, ids, fit.bias.to(head.bias))
        return {
            "fitted_on": self.scorer.fitted_on,
            "n": fit.n,
            "n_tokens": len(self.token_ids),
            "l2": self.l2,
            "nll_before": fit.nll_before,
            "nll_after": fit.nll_after,
            "iterations": fit.iterations,
            "head": head_record(self.model.head, self.token_ids),
        }


class Oracle(PosthocOptions):
    """The known inverse of the run's distortion as a per-token head: d* = 1 / k on every
    token, l* = -b / k on S+ (models/logit_distortion.py). It reproduces the clean model's
    logits up to rounding, so its row is the undistorted base."""

    head = HEAD_VECTOR
    mcqa_splits = ()

    def fit(self, collected: list) -> dict:
        distortion = installed_distortion(self.model.lm)
        if distortion is None:
            raise ConfigError(
                "method=oracle needs a model loaded by calm_lightning (its logit_scale and "
                "logit_distortion recorded on it)"
            )
        scale, bias = distortion.inverse(self.model.vocab_size)
        with torch.no_grad():
            self.model.head.scale.copy_(scale)
            self.model.head.bias.copy_(bias)
        return {
            "fitted_on": "known_distortion",
            "d": 1.0 / distortion.scale,
            "l_on_s_plus": -distortion.bias / distortion.scale,
            "n_tokens": len(distortion.token_ids),
        }
