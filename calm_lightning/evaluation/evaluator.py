"""The test pass apart from Lightning: each test batch's results, gathered from every process
in single-process order, each question counted once, aggregated into predictions and metrics.

A method owns one `TestEvaluator` (methods/base.py) and its test hooks only hand it the loader,
each batch and the end of the pass. MCQA batches arrive scored by the method (`ScoredOptions`:
option probabilities, stated answers, the scorer's side choices such as cloze's acc_norm);
open-QA batches are sampled here, each from a generator seeded by the batch's index.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device

from calm_lightning.data.records import OpenQARecord
from calm_lightning.evaluation.mcqa import OptionTokens
from calm_lightning.evaluation.openqa import OpenQAPredictions, OpenQASettings, score_openqa_batch
from calm_lightning.evaluation.results import mcqa_evaluation, plot_mcqa_reliability
from calm_lightning.metrics.bootstrap import BootstrapSettings, ScoredQuestions
from calm_lightning.metrics.by_source import question_spread
from calm_lightning.metrics.calibration import calibration_report
from calm_lightning.runtime.distributed import gather_objects, world


class ScoredOptions(NamedTuple):
    """One MCQA test batch as a method scores it (`option_probabilities`)."""

    probs: torch.Tensor  # (B, K) option probabilities
    predicted: torch.Tensor | None = None  # (B,) stated answers; None = the argmax of probs
    side: torch.Tensor | None = None  # (B,) the scorer's side choices (cloze: acc_norm's)


class MCQABatch(NamedTuple):
    """What the evaluator keeps of one MCQA test batch (on the CPU, as the gather sends it)."""

    ids: list[str]
    probs: torch.Tensor  # (B, K) float64
    labels: torch.Tensor  # (B,)
    predicted: torch.Tensor | None
    side: torch.Tensor | None


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

    def spread(self, n_bins: int, settings: BootstrapSettings, sources: dict) -> dict:
        """metrics.json's `ci95` and, for a pooled test, `by_source` (`sources`: question id
        -> the source its record names)."""

        def row(index):
            index = slice(None) if index is None else index
            stated = None if self.predicted is None else self.predicted[index]
            return ScoredQuestions.from_probs(self.probs[index], self.labels[index], stated, n_bins)

        return question_spread(row, [sources.get(i) for i in self.ids], settings)

    def evaluation(self, metrics: dict, meta: dict):
        """The run record of this evaluation (metrics.json payload, predictions rows)."""
        return mcqa_evaluation(self, metrics, meta)

    def plot_reliability(self, path, title: str = "") -> None:
        plot_mcqa_reliability(self, path, title=title)


def unique_by_id(items: list, key) -> list:
    """`items` without repeats of an id already seen (first occurrence kept, order kept).

    The project's test loader never repeats a question; a sampler that pads shards to equal
    length (Lightning's DistributedSampler, if `use_distributed_sampler` is switched on)
    would, and each question must count once."""
    seen: set = set()
    out = []
    for item in items:
        k = key(item)
        if k not in seen:
            seen.add(k)
            out.append(item)
    return out


def probe_batch(loader, size: int, device) -> dict | None:
    """The first `size` questions of a test loader as one batch on `device` (None: no
    questions), for choosing the option tokens."""
    records = [loader.dataset[i] for i in range(min(size, len(loader.dataset)))]
    if not records:
        return None
    return move_data_to_device(loader.collate_fn(records), device)


class TestEvaluator:
    """One test pass at a time: `start(loader, ...)`, then `add` (an MCQA batch the method
    scored) or `sample` (an open-QA batch) per batch, then `finish()` -> the metrics report,
    with the predictions in `predictions`.

    `gather` (every process's list of batches, in rank order) and `world` ((rank, world
    size)) default to this process group's (runtime/distributed.py); a test passes its own.
    """

    __test__ = False  # a class named Test* that pytest must not collect

    def __init__(
        self,
        scorer,
        n_bins: int = 10,
        openqa: OpenQASettings | dict | None = None,
        gather: Callable[[list], list] = gather_objects,
        world: Callable[[], tuple[int, int]] = world,
    ) -> None:
        self.scorer = scorer
        self.n_bins = n_bins
        self.openqa = (
            openqa if isinstance(openqa, OpenQASettings) else OpenQASettings(**(openqa or {}))
        )
        self.gather, self.world = gather, world
        self.split = "test"  # what the pass's numbers are logged under (heldout_pass.py: heldout)
        self.open_ended = False
        self.option_tokens: OptionTokens | None = None
        self.predictions: MCQAPredictions | OpenQAPredictions | None = None
        self._batches: list[tuple[int, MCQABatch | list]] = []
        self._n_test, self._n_global = 0, None

    def start(self, loader, model, tokenizer, device, option_tokens=None) -> OptionTokens | None:
        """Begin a pass over `loader`; returns the option tokens MCQA is scored with: the run's
        earlier choice (`option_tokens`: the base row's holds for the method's), else the
        scorer's on a probe of the first test questions."""
        dataset = loader.dataset
        self._batches = []
        self._n_test = len(dataset)
        # Set by the project's sharded test sampler: indices >= it are copies idle processes
        # scored (runtime/distributed.py).
        self._n_global = getattr(loader.batch_sampler, "n_global", None)
        self.open_ended = len(dataset) > 0 and isinstance(dataset[0], OpenQARecord)
        if self.open_ended:
            return option_tokens
        if option_tokens is None:
            size = self.scorer.probe_size
            probe = probe_batch(loader, size, device) if size else None
            option_tokens = self.scorer.select_option_tokens(model, tokenizer, probe)
        self.option_tokens = option_tokens
        return option_tokens

    def batch_index(self, batch_idx: int) -> int:
        """A batch's index in the single-process order, whatever the world size: the test
        loader hands whole batches to the processes in turn (data module)."""
        rank, size = self.world()
        return batch_idx * size + rank

    def add(self, batch: dict, batch_idx: int, scored: ScoredOptions) -> None:
        """Keep an MCQA batch's scores (probabilities in float64, everything on the CPU)."""
        predicted, side = scored.predicted, scored.side
        kept = MCQABatch(
            list(batch["ids"]),
            scored.probs.double().cpu(),
            batch["labels"].cpu(),
            None if predicted is None else predicted.cpu(),
            None if side is None else side.cpu(),
        )
        self._batches.append((self.batch_index(batch_idx), kept))

    def sample(self, model, tokenizer, batch: dict, batch_idx: int, device) -> None:
        """Sample, cluster and grade an open-QA batch. Each batch draws from its own stream,
        seeded by its index: the same samples on any number of processes, and for base and
        method in one run (common random numbers for their comparison)."""
        index = self.batch_index(batch_idx)
        generator = torch.Generator(device=device)
        generator.manual_seed(self.openqa.seed * 1_000_003 + index)
        rows = score_openqa_batch(model, tokenizer, batch, self.openqa, generator)
        self._batches.append((index, rows))

    def finish(self) -> dict[str, float]:
        """Gather, count each question once, aggregate (`predictions`); the metrics report."""
        batches = self._gathered()
        self._batches = []
        if self.open_ended:
            rows = [row for batch in batches for row in batch]
            if len(rows) > self._n_test:
                rows = unique_by_id(rows, lambda row: row["id"])
            self.predictions = OpenQAPredictions(rows, self.openqa)
        else:
            self.predictions = self._mcqa_predictions(batches)
        return self.predictions.report(self.n_bins)

    def _gathered(self) -> list:
        """Every process's batches (one process: its own), in single-process order."""
        entries = [entry for kept in self.gather(self._batches) for entry in kept]
        if self._n_global is not None:  # drop the copies idle processes scored
            entries = [entry for entry in entries if entry[0] < self._n_global]
        return [batch for _, batch in sorted(entries, key=lambda entry: entry[0])]

    def _mcqa_predictions(self, batches: list[MCQABatch]) -> MCQAPredictions:
        ids = [i for batch in batches for i in batch.ids]
        probs = torch.cat([batch.probs for batch in batches]).numpy()
        labels = torch.cat([batch.labels for batch in batches]).numpy()
        stated = [batch.predicted for batch in batches]
        predicted = None if stated[0] is None else torch.cat(stated).numpy()
        keep = list(range(len(ids)))
        if len(ids) > self._n_test:  # a padding sampler repeated questions: count each once
            keep = unique_by_id(keep, ids.__getitem__)
            ids = [ids[i] for i in keep]
            probs, labels = probs[keep], labels[keep]
            predicted = None if predicted is None else predicted[keep]
        extra = {}
        sided = [batch for batch in batches if batch.side is not None]
        if sided:  # e.g. cloze's acc_norm choices
            chosen = torch.cat([batch.side for batch in sided])
            gold = torch.cat([batch.labels for batch in sided])
            if len(keep) < len(chosen):
                chosen, gold = chosen[keep], gold[keep]
            extra.update(self.scorer.extra_metrics(chosen, gold))
        return MCQAPredictions(ids, probs, labels, self.option_tokens, predicted, extra)
