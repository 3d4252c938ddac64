"""Temperature scaling (post hoc, no training): one T fitted on held-out data, applied as a
scalar logit-adjustment head (d = 1 / T, l = 0), so evaluation, metrics and saved files are the
same as for every other method.

Where T is fitted follows the paper: in the ID setting on the first half of the MCQA
calibration split (option-letter NLL); in the OOD setting on the training domain's held-out
data (next-token NLL at instruction response positions), then applied to MCQA, which is why
TS can fail out of domain.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from torch.utils.data import DataLoader

from calm_lightning.calibrators.temperature import fit_temperature
from calm_lightning.config_rules import Number
from calm_lightning.errors import ConfigError
from calm_lightning.methods.base import PosthocTemperature
from calm_lightning.methods.objectives import select_response_logits

log = logging.getLogger(__name__)


class TemperatureScaling(PosthocTemperature):
    """One T by scipy's bounded minimiser of NLL on held-out data (docs/baselines.md).

    With `evaluation.scoring=cloze` and MCQA held-out data, T is fitted on the cloze option
    distribution through the same scoring path evaluation uses (the head d = 1 / T acting on
    every continuation token's logits). There T can change the accuracy: the temperature acts
    on each token before the per-option sum, which may reorder options of different lengths."""

    scorers = ("letter", "cloze")
    config_rules: ClassVar[dict] = {
        "calibration_fraction": Number(minimum=0, maximum=1, exclusive_minimum=True),
        "max_positions": Number(minimum=1, integer=True),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        calibration_fraction: float = 0.5,
        max_positions: int = 2048,
        seed: int = 0,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(calibration_fraction=calibration_fraction, max_positions=max_positions)
        if model.head is None or model.head.kind != "scalar":
            raise ConfigError("temperature scaling needs a scalar head (build_model makes one)")
        self.calibration_fraction = float(calibration_fraction)
        self.max_positions = int(max_positions)
        self.seed = int(seed)
        self.fit_info: dict = {}

    # ----- which data the temperature is fitted on -----
    def posthoc_loader(self, datamodule) -> DataLoader:
        if datamodule.sources.get("heldout") is None:
            raise ConfigError("temperature scaling needs held-out data (setting.heldout)")
        records = datamodule._load("heldout")
        self._kind = datamodule.sources["heldout"].kind
        if self._kind == "mcqa":
            n = max(1, int(len(records) * self.calibration_fraction))
            return DataLoader(
                records[:n],
                batch_size=datamodule.eval_batch_size,
                collate_fn=datamodule.test_collator,
            )
        return datamodule.ordered_heldout_dataloader()

    def on_predict_start(self) -> None:
        self.model.eval()
        self._rows: list[torch.Tensor] = []
        self._targets: list[torch.Tensor] = []
        self._seen = 0
        self._generator = torch.Generator().manual_seed(self.seed)

    @torch.no_grad()
    def predict_step(self, batch: dict, batch_idx: int) -> None:
        head = self.model.head
        self.model.head = None  # fit on the model's own logits, not through the current head
        try:
            if self._kind == "mcqa":
                if self.option_tokens is None:  # no base row scored yet: choose them here
                    self.option_tokens = self.scorer.select_option_tokens(
                        self.model, self.tokenizer, batch
                    )
                # The scorer's own option distribution (letters, or option likelihood).
                rows = self.scorer.temperature_rows(
                    self.model, self.tokenizer, batch, self.option_tokens, self.eval_max_length
                )
                self._rows.append(rows)
                self._targets.append(batch["labels"].cpu())
            else:
                raw = self.model.raw_logits(batch["input_ids"], batch["attention_mask"])
                rows, targets = select_response_logits(raw, batch["labels"])
                self._reservoir(rows.float().cpu(), targets.cpu())
        finally:
            self.model.head = head

    def _reservoir(self, rows: torch.Tensor, targets: torch.Tensor) -> None:
        """Keep a uniform random sample of at most `max_positions` response positions
        (vocabulary-wide rows are too large to keep them all)."""
        if not self._rows:
            self._rows.append(torch.empty(self.max_positions, rows.shape[1]))
            self._targets.append(torch.empty(self.max_positions, dtype=torch.long))
        kept_rows, kept_targets = self._rows[0], self._targets[0]
        for row, target in zip(rows, targets, strict=True):
            if self._seen < self.max_positions:
                slot = self._seen
            else:
                slot = int(torch.randint(0, self._seen + 1, (1,), generator=self._generator))
            if slot < self.max_positions:
                kept_rows[slot], kept_targets[slot] = row, target
            self._seen += 1

    def fit_posthoc(self) -> dict:
        """Fit T on what the predict pass collected and install d = 1 / T."""
        labels = torch.cat(self._targets)
        if self._kind == "mcqa":
            fit = self.scorer.fit_temperature(self._rows, labels)
        else:  # the reservoir buffer may not be full
            logits, labels = self._rows[0][: self._seen], labels[: self._seen]
            fit = fit_temperature(logits, labels)
        with torch.no_grad():
            self.model.head.scale.fill_(1.0 / fit.temperature)
            self.model.head.bias.zero_()
        self.fit_info = {
            "temperature": fit.temperature,
            "fitted_on": self.scorer.fitted_on
            if self._kind == "mcqa"
            else "heldout_response_tokens",
            "n": fit.n,
            "nll_before": fit.nll_before,
            "nll_after": fit.nll_after,
            "at_bound": fit.at_bound,
        }
        log.info("temperature scaling: %s", self.fit_info)
        self._rows, self._targets = [], []
        return self.fit_info
