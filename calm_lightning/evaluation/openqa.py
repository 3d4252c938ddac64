"""Open-ended QA evaluation (Sem-ECE): sample n answers per question with the calibrated model,
cluster equivalent answers, take the largest cluster's answer and share, grade it against the
gold aliases, then record the same metrics, predictions and reliability diagram as MCQA.

Defaults follow the paper: 20 samples per question at temperature 1.0, 10 equal-width bins.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch

from calm_lightning.config_rules import Flag, Number, OneOf, check_values
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.sampling import sample_answers
from calm_lightning.metrics.bootstrap import BootstrapSettings, ScoredQuestions
from calm_lightning.metrics.by_source import question_spread
from calm_lightning.metrics.ranking import SELECTIVE_COVERAGE, aurc, auroc, selective_accuracy
from calm_lightning.metrics.reliability import plot_confidence_reliability
from calm_lightning.metrics.semantic import (
    Clusterer,
    ExactMatchClusterer,
    extract_answer,
    grade,
    modal_answer,
    semantic_ece,
    split_half_answer,
)
from calm_lightning.runtime.run_record import Evaluation

CONFIDENCES = ("modal", "split_half")


@dataclass
class OpenQASettings:
    """How open-ended answers are sampled, clustered and graded (`evaluation.openqa`)."""

    n_samples: int = 20
    temperature: float = 1.0
    max_new_tokens: int = 16
    clusterer: Clusterer = field(default_factory=ExactMatchClusterer)
    f1_threshold: float = 0.8
    containment: bool = True
    confidence: str = "modal"
    seed: int = 0

    # The rules of its keys: checked here and, on the composed config, before any model loads.
    rules: ClassVar[dict] = {
        "n_samples": Number(minimum=1, integer=True),
        "temperature": Number(minimum=0, exclusive_minimum=True),
        "max_new_tokens": Number(minimum=1, integer=True),
        "f1_threshold": Number(minimum=0, maximum=1),
        "containment": Flag(),
        "confidence": OneOf(CONFIDENCES),
    }

    def __post_init__(self) -> None:
        values = {key: getattr(self, key) for key in self.rules}
        check_values("evaluation.openqa", values, self.rules)
        if self.n_samples < (2 if self.confidence == "split_half" else 1):
            raise ConfigError("evaluation.openqa.n_samples is too small for this confidence")


def score_openqa_batch(
    model, tokenizer, batch: dict, settings: OpenQASettings, generator: torch.Generator
) -> list[dict]:
    """Sample, cluster and grade one batch of questions; one result row per question."""
    texts = sample_answers(
        model,
        tokenizer,
        batch["prompts"],
        n=settings.n_samples,
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        batch_size=len(batch["prompts"]),
        generator=generator,
    )
    choose = split_half_answer if settings.confidence == "split_half" else modal_answer
    rows = []
    for qid, question, aliases, raw in zip(
        batch["ids"], batch["questions"], batch["answers"], texts, strict=True
    ):
        samples = [extract_answer(t) for t in raw]
        clusters = settings.clusterer(samples, question)
        prediction = choose(samples, ids=clusters)
        correct = grade(prediction.answer, aliases, settings.f1_threshold, settings.containment)
        rows.append(
            {
                "id": qid,
                "question": question,
                "aliases": list(aliases),
                "answer": prediction.answer,
                "confidence": prediction.confidence,
                "correct": bool(correct),
                "unattempted": prediction.unattempted,
                "n_clusters": prediction.n_clusters,
                "samples": samples,
                "clusters": [int(c) for c in clusters],
            }
        )
    return rows


@dataclass
class OpenQAPredictions:
    """Per-question results of an open-ended test split, in dataset order."""

    rows: list[dict]
    settings: OpenQASettings

    @property
    def confidences(self) -> np.ndarray:
        return np.array([r["confidence"] for r in self.rows], dtype=float)

    @property
    def correct(self) -> np.ndarray:
        return np.array([r["correct"] for r in self.rows], dtype=bool)

    def report(self, n_bins: int = 10) -> dict[str, float]:
        if not self.rows:
            raise ValueError("no open-ended questions were scored")
        conf, correct = self.confidences, self.correct
        return {
            "sem_ece": semantic_ece(conf, correct, n_bins),
            "accuracy": float(correct.mean()),
            "auroc": auroc(conf, correct),
            "aurc": aurc(conf, correct),
            "sel_acc_80": selective_accuracy(conf, correct, SELECTIVE_COVERAGE),
            "mean_confidence": float(conf.mean()),
            "unattempted": float(np.mean([r["unattempted"] for r in self.rows])),
            "mean_clusters": float(np.mean([r["n_clusters"] for r in self.rows])),
            "n": len(self.rows),
        }

    def spread(self, n_bins: int, settings: BootstrapSettings, sources: dict) -> dict:
        """metrics.json's `ci95` (Sem-ECE, accuracy and the ranking metrics) and, when the
        questions come from several sources, `by_source`."""
        conf, correct = self.confidences, self.correct

        def row(index):
            index = slice(None) if index is None else index
            return ScoredQuestions(conf[index], correct[index], n_bins=n_bins)

        keys = [sources.get(r["id"]) for r in self.rows]
        spread = question_spread(row, keys, settings, rename={"conf_ece": "sem_ece"})
        kept = {"sem_ece", "accuracy", "auroc", "aurc", "sel_acc_80"}
        spread["ci95"] = {k: v for k, v in spread["ci95"].items() if k in kept}
        return spread

    def evaluation(self, metrics: dict, meta: dict) -> Evaluation:
        """The run record: metrics.json's payload and one predictions row per question
        (samples, clusters, confidence, correctness)."""
        summary = {"metrics": metrics, **meta, "task": "openqa", "sampling": self.describe()}
        rows = [dict(row, confidence=round(row["confidence"], 6)) for row in self.rows]
        return Evaluation(summary, rows)

    def plot_reliability(self, path: Path, title: str = "") -> None:
        plot_confidence_reliability(self.confidences, self.correct, path, title=title)

    def describe(self) -> dict:
        """The sampling / clustering / grading settings, for metrics.json."""
        s = self.settings
        return {
            "n_samples": s.n_samples,
            "temperature": s.temperature,
            "max_new_tokens": s.max_new_tokens,
            "clusterer": type(s.clusterer).__name__,
            "clusterer_threshold": getattr(s.clusterer, "threshold", None),
            "f1_threshold": s.f1_threshold,
            "containment": s.containment,
            "confidence": s.confidence,
            "seed": s.seed,
        }
