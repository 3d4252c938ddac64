"""The shared LightningModule: every method is evaluated by the same test loop here (MCQA
option scoring, or sampling + Sem-ECE when the test split is open-ended QA).

A training method subclasses `CalibrationMethod`, sets `trains = True` and implements
`training_step` / `configure_optimizers`; evaluation, metrics and result files stay shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device

from calm_lightning.calibration.metrics import calibration_report
from calm_lightning.data.records import OpenQARecord
from calm_lightning.evaluation.mcqa import OptionTokens, choose_option_tokens, score_options
from calm_lightning.evaluation.openqa import OpenQAPredictions, OpenQASettings, score_openqa_batch
from calm_lightning.models.calibrated_lm import CalibratedLM


@dataclass
class MCQAPredictions:
    """Option probabilities of a test split, in dataset order."""

    ids: list[str]
    probs: np.ndarray  # (N, K) float64
    labels: np.ndarray  # (N,)
    option_tokens: OptionTokens
    predicted: np.ndarray | None = None  # (N,) stated answers; None = argmax of probs
    extra: dict = field(default_factory=dict)  # method-specific counts for metrics.json

    def report(self, n_bins: int = 10) -> dict[str, float]:
        metrics = calibration_report(
            self.probs, self.labels, n_bins=n_bins, predictions=self.predicted
        )
        return {**metrics, **self.extra}


class CalibrationMethod(L.LightningModule):
    """Holds the calibrated LM and scores MCQA test batches."""

    trains = False

    def __init__(
        self,
        model: CalibratedLM,
        tokenizer=None,
        option_tokens: str = "auto",
        probe_size: int = 8,
        n_bins: int = 10,
        openqa: OpenQASettings | dict | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.option_token_style = option_tokens
        self.probe_size = probe_size
        self.n_bins = n_bins
        self.option_tokens: OptionTokens | None = None
        self.predictions: MCQAPredictions | OpenQAPredictions | None = None
        self.openqa = (
            openqa if isinstance(openqa, OpenQASettings) else OpenQASettings(**(openqa or {}))
        )
        self._test_rows: list = []
        self._open_ended = False

    # ----- evaluation (shared) -----
    def _test_loader(self):
        loader = self.trainer.test_dataloaders
        return loader[0] if isinstance(loader, list | tuple) else loader

    def _probe_batch(self) -> dict | None:
        loader = self._test_loader()
        records = [loader.dataset[i] for i in range(min(self.probe_size, len(loader.dataset)))]
        if not records:
            return None
        return move_data_to_device(loader.collate_fn(records), self.device)

    def on_test_start(self) -> None:
        self.model.eval()
        self._test_rows = []
        dataset = self._test_loader().dataset
        self._open_ended = len(dataset) > 0 and isinstance(dataset[0], OpenQARecord)
        if self._open_ended:
            # Every evaluation draws the same random stream (common random numbers for the
            # base-versus-method comparison in one run).
            self._generator = torch.Generator(device=self.device).manual_seed(self.openqa.seed)
            return
        if self.option_tokens is None:
            probe = self._probe_batch()
            n_options = probe["n_options"] if probe else 4
            self.option_tokens = choose_option_tokens(
                self.model, self.tokenizer, probe, self.option_token_style, n_options
            )

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if self._open_ended:
            self._test_rows += score_openqa_batch(
                self.model, self.tokenizer, batch, self.openqa, self._generator
            )
            return
        probs, predicted = self.option_probabilities(batch)
        self._test_rows.append(
            (list(batch["ids"]), probs.double().cpu(), batch["labels"].cpu(), predicted)
        )

    def option_probabilities(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, K) option probabilities and, for methods that state their answer apart from
        the probabilities, the (B,) answers (None = the argmax). Methods that produce their
        confidence differently (IC, CAPE, elicitation) override this, nothing else."""
        logits = score_options(self.model, batch, self.option_tokens)
        return torch.softmax(logits.double(), dim=-1), None

    def on_test_epoch_end(self) -> None:
        if self._open_ended:
            self.predictions = OpenQAPredictions(self._test_rows, self.openqa)
        else:
            self.predictions = self._mcqa_predictions()
        metrics = self.predictions.report(self.n_bins)
        self.log_dict({f"test/{k}": float(v) for k, v in metrics.items()}, sync_dist=False)
        self._test_rows = []

    def _mcqa_predictions(self) -> MCQAPredictions:
        ids = [i for rows, _, _, _ in self._test_rows for i in rows]
        probs = torch.cat([p for _, p, _, _ in self._test_rows]).numpy()
        labels = torch.cat([y for _, _, y, _ in self._test_rows]).numpy()
        stated = [a for _, _, _, a in self._test_rows]
        predicted = None if stated[0] is None else torch.cat(stated).cpu().numpy()
        return MCQAPredictions(ids, probs, labels, self.option_tokens, predicted)

    def save_calibration(self, directory) -> None:
        """Write what training changed (adapter + head) to `directory`."""
        self.model.save(directory)


class BaseMethod(CalibrationMethod):
    """The aligned model as it is (the paper's DPO / RLHF row): no training."""

    trains = False
