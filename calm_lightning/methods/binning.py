"""Top-label post-hoc baselines a reviewer asks for beside temperature scaling: histogram
binning (`hb`) and isotonic regression (`isotonic`), fitted where `ts` is fitted and reported
like every method (docs/baselines.md).

Fit data, as for `ts`: with MCQA held-out data (ID) the first `calibration_fraction` of the
calibration split, scored by the run's MCQA scorer (the option distribution evaluation scores);
with instruction held-out data (OOD) every response position of the held-out split, scored over
the vocabulary (the token's top probability and whether it is the target), then applied to
MCQA. The map (calibrators/top_label.py) replaces the test answer's confidence; the answer stays
the argmax (a stated answer), so accuracy is the base row's.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import ClassVar

import torch
from torch.utils.data import DataLoader

from calm_lightning.calibrators.top_label import (
    TopLabelMap,
    fit_histogram_binning,
    fit_isotonic,
    recalibrate,
)
from calm_lightning.config_rules import Number
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.evaluator import ScoredOptions
from calm_lightning.methods.objectives import select_response_logits
from calm_lightning.methods.per_token import PosthocOptions, calibration_half
from calm_lightning.runtime.distributed import gather_objects
from calm_lightning.runtime.run_record import write_text_atomic

log = logging.getLogger(__name__)

MAP_FILE = "top_label_map.json"  # in the run's calibration/ folder


class TopLabelPosthoc(PosthocOptions):
    """A map of the top option's confidence, fitted on held-out (confidence, correct) pairs;
    subclasses say how (`fit_map`)."""

    needs_heldout = True
    config_rules: ClassVar[dict] = {
        "calibration_fraction": Number(minimum=0, maximum=1, exclusive_minimum=True),
    }

    def __init__(self, model, tokenizer=None, calibration_fraction: float = 0.5, **evaluation):
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(calibration_fraction=calibration_fraction)
        self.calibration_fraction = float(calibration_fraction)
        self.mapping: TopLabelMap | None = None

    def fit_map(self, confidences, correct) -> TopLabelMap:
        raise NotImplementedError

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        """One predict pass over the fit data (the model's own scores), the map fitted on every
        process's pairs."""
        heldout = datamodule.sources.get("heldout")
        if heldout is None:
            raise ConfigError(f"{type(self).__name__} needs held-out data (setting.heldout)")
        self._kind = heldout.kind
        if self._kind == "mcqa":
            loader = DataLoader(
                calibration_half(datamodule, self.calibration_fraction),
                batch_size=datamodule.eval_batch_size,
                collate_fn=datamodule.test_collator,
            )
        else:
            loader = datamodule.ordered_heldout_dataloader()
        self._collected = []
        trainer.predict(self, dataloaders=loader, return_predictions=False)
        pairs = [item for rank in gather_objects(self._collected) for item in rank]
        self._collected = []
        confidences = torch.cat([c for c, _ in pairs]).numpy()
        correct = torch.cat([h for _, h in pairs]).numpy()
        self.mapping = self.fit_map(confidences, correct)
        fitted_on = self.scorer.fitted_on if self._kind == "mcqa" else "heldout_response_tokens"
        record = {**self.mapping.record(), "fitted_on": fitted_on}
        record["fit_accuracy"] = float(correct.mean())
        log.info("%s: %s fitted on %d pairs", type(self).__name__, fitted_on, self.mapping.n)
        return {"posthoc": record}

    @torch.no_grad()
    def predict_step(self, batch: dict, batch_idx: int) -> None:
        head = self.model.head
        self.model.head = None  # the model's own scores
        try:
            if self._kind == "mcqa":
                if self.option_tokens is None:  # no base row scored yet: choose them here
                    self.option_tokens = self.scorer.select_option_tokens(
                        self.model, self.tokenizer, batch
                    )
                logits, target = self.scored_logits(batch), batch["labels"]
            else:  # next-token predictions at the held-out responses' positions
                raw = self.model.raw_logits(batch["input_ids"], batch["attention_mask"])
                logits, target = select_response_logits(raw, batch["labels"])
            # the top probability without a (positions x vocabulary) softmax in memory
            logits = logits.float()
            top, answer = logits.max(dim=-1)
            confidence = torch.exp(top - torch.logsumexp(logits, dim=-1)).double().cpu()
            correct = (answer.cpu() == target.cpu()).double()
            self._collected.append((confidence, correct))
        finally:
            self.model.head = head

    def option_probabilities(self, batch: dict) -> ScoredOptions:
        scored = super().option_probabilities(batch)
        if self.mapping is None:  # before calibration (the base row): the model as it is
            return scored
        probs, answer = recalibrate(scored.probs.cpu().numpy(), self.mapping)
        return ScoredOptions(
            torch.from_numpy(probs).to(scored.probs),
            torch.from_numpy(answer).to(scored.probs.device),
            scored.side,
        )

    def save_calibration(self, directory) -> None:
        super().save_calibration(directory)
        if self.mapping is not None:
            text = json.dumps(self.mapping.record(), indent=2) + "\n"
            write_text_atomic(Path(directory) / MAP_FILE, text)


class HistogramBinning(TopLabelPosthoc):
    """Histogram binning: `bins` equal-mass bins of the fit confidences, each mapped to its
    accuracy (Zadrozny & Elkan 2001)."""

    config_rules: ClassVar[dict] = {"bins": Number(minimum=1, integer=True)}

    def __init__(self, model, tokenizer=None, bins: int = 10, **rest) -> None:
        super().__init__(model, tokenizer, **rest)
        self.check_arguments(bins=bins)
        self.bins = int(bins)

    def fit_map(self, confidences, correct) -> TopLabelMap:
        return fit_histogram_binning(confidences, correct, self.bins)


class IsotonicCalibration(TopLabelPosthoc):
    """Isotonic regression of correctness on confidence (scikit-learn)."""

    def fit_map(self, confidences, correct) -> TopLabelMap:
        return fit_isotonic(confidences, correct)
