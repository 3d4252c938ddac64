"""`CalibrationLogitsProcessor`: an exported model's calibration as a transformers
`LogitsProcessor`, so `model.generate(..., logits_processor=[processor])` and the
text-generation pipeline sample from the calibrated distribution with plain transformers.

Only torch, safetensors, transformers (and huggingface_hub, for a Hub id) are imported here,
besides the head's own module: the export copies this file into its folder as
`calibration_processor.py`, where it runs without this project installed
(`transformers.dynamic_module_utils.get_class_from_dynamic_module(
"calibration_processor.CalibrationLogitsProcessor", folder_or_hub_id)`). It lives beside the
head it applies (logit_adjustment.py), below evaluation, which samples retention tasks through
it. The folder format is described in docs/export.md; `python -m calm_lightning.export`
writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LogitsProcessor

from calm_lightning.models.logit_adjustment import HEAD_FILE, LogitAdjustment

CALIBRATION_FILE = "calibration.json"  # what the calibration is: formula, method, prompt format


# What the processor is given: "logits" (greedy decoding and sampling hand processors the
# model's logits) or "log_probs" (beam search hands them log_softmax(z)).
SCORES = ("logits", "log_probs")
# Told "logits" but handed rows whose logsumexp are all within this of 0: log-probabilities
# (raw logits of a language model sit far above 0), so the processor stops instead of
# calibrating the wrong thing. A guard only: what the scores are is never guessed.
LOG_PROB_TOLERANCE = 1e-4


def read_calibration(folder: str | Path) -> dict:
    """The exported folder's calibration.json."""
    path = Path(folder) / CALIBRATION_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: {folder} is not a folder written by `python -m "
            "calm_lightning.export`"
        )
    return json.loads(path.read_text())


class CalibrationLogitsProcessor(LogitsProcessor):
    """Applies the calibration head z' = d * (z - c) + l to the next-token scores.

    d and l are per-vocabulary vectors (`vector` head) or one number each (`scalar` head; a
    post-hoc temperature T is d = 1 / T, l = 0); c is 0, logsumexp(z) or mean(z) over the
    vocabulary (the head's `center`). Without a head (methods that only train adapters) the
    processor leaves the scores as they are.

    transformers runs the processors passed to `generate` after its own logit processors
    (repetition penalty, bad words, ...) and before the sampling warpers (temperature, top-k,
    top-p), so `temperature=t` samples from softmax(z' / t) as the project's sampler does.

    Beam search hands processors log_softmax(z), not z, and adds what they return to the
    beams' running scores: pass `scores="log_probs"` there (the default `"logits"` is what
    greedy decoding and sampling hand over). A scalar head, a head centred on logsumexp, or
    one centred on the mean when no earlier processor masked tokens, gives the same
    distribution from log-probabilities as from logits; the processor then returns the
    calibrated log-probabilities, so the beams accumulate exactly the calibrated sequence
    log-probability. A vector head without centering does not (d * (z - lse z) + l is not
    d * z + l up to a constant): there it refuses with a message instead of searching the
    wrong distribution. Told `"logits"` but handed rows that are all normalised, it stops
    with a message rather than calibrating log-probabilities as if they were logits.
    """

    def __init__(self, head: LogitAdjustment | None, scores: str = "logits") -> None:
        if scores not in SCORES:
            raise ValueError(f"scores={scores!r} is not one of {', '.join(SCORES)}")
        self.head = None if head is None else head.eval().requires_grad_(False)
        self.scores = scores

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | Path, revision: str | None = None, scores: str = "logits"
    ) -> CalibrationLogitsProcessor:
        """The processor of an exported folder, a local path or a Hub id (its calibration
        head, or the identity where the weights carry the calibration); `scores`: what
        `generate` hands it, "logits" (greedy, sampling) or "log_probs" (beam search)."""
        folder = Path(name_or_path)
        if not folder.is_dir():
            folder = _download(str(name_or_path), revision)
        info = read_calibration(folder)
        if info.get("head") is None or info["head"].get("file", HEAD_FILE) is None:
            return cls(None, scores)  # no head, or one folded into the weights
        if info["head"].get("file", HEAD_FILE) != HEAD_FILE:
            raise ValueError(f"{folder}: the head file must be named {HEAD_FILE}")
        return cls(LogitAdjustment.load(folder), scores)

    @property
    def temperature(self) -> float | None:
        """T for a pure temperature head (scalar d, l = 0, no centering), else None."""
        head = self.head
        if head is None or head.kind != "scalar" or head.center != "none" or head.bias.item():
            return None
        return 1.0 / head.scale.item()

    def log_prob_obstacle(self, masked: bool) -> str | None:
        """Why the head cannot be applied exactly to log-probabilities (None: it can)."""
        head = self.head
        if head is None or head.kind == "scalar" or head.center == "logsumexp":
            return None  # a constant per position; logsumexp-centred z is log_softmax(z) itself
        if head.center == "mean" and not masked:
            return None  # s - mean(s) = z - mean(z)
        if head.center == "mean":
            return "the mean of the logits is lost once earlier processors masked tokens"
        return "d * (z - lse z) + l is not d * z + l up to a constant"

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return scores
        if self.head.scale.device != scores.device:
            self.head.to(scores.device)
        finite = torch.isfinite(scores)
        if self.scores == "logits":
            if bool((torch.logsumexp(scores.float(), dim=-1).abs() <= LOG_PROB_TOLERANCE).all()):
                raise ValueError(
                    "these scores are normalised log-probabilities (beam search passes "
                    "log_softmax(z) to logits processors), but this processor was built for "
                    'logits: build it with scores="log_probs" for beam search'
                )
            return self._adjust(scores, finite)
        obstacle = self.log_prob_obstacle(masked=not bool(finite.all()))
        if obstacle is not None:
            raise ValueError(
                "these scores are log-probabilities (beam search passes log_softmax(z) to "
                f"logits processors), and this head ({self.head.kind}, center="
                f"{self.head.center}) cannot be applied to them exactly: {obstacle}. Load the "
                "folder with AutoModelForCausalLM.from_pretrained(folder, "
                "trust_remote_code=True), whose forward applies the head to the logits "
                "themselves, and generate without this processor; or decode greedily / by "
                "sampling."
            )
        # log_softmax(z) is z - lse(z) already, masked entries or not: no second centering.
        center = "none" if self.head.center == "logsumexp" else self.head.center
        adjusted = self._adjust(scores, finite, center)
        # Normalized, so the beams add up the calibrated log-probabilities themselves.
        return torch.log_softmax(adjusted, dim=-1)

    def _adjust(
        self, scores: torch.Tensor, finite: torch.Tensor, center: str | None = None
    ) -> torch.Tensor:
        """The head on `scores` (`finite`: their finite entries), centred as the head says
        or as `center` overrides."""
        center = self.head.center if center is None else center
        if center == self.head.center and bool(finite.all()):
            return self.head(scores)
        # An earlier processor masked some tokens (-inf): centre on the tokens still allowed
        # (a mean over -inf is undefined) and keep the masked ones masked.
        z = scores.float()
        if center == "logsumexp":
            z = z - torch.logsumexp(z, dim=-1, keepdim=True)
        elif center == "mean":
            count = finite.sum(-1, keepdim=True).clamp(min=1)
            z = z - z.masked_fill(~finite, 0.0).sum(-1, keepdim=True) / count
        adjusted = torch.addcmul(self.head.bias, z.masked_fill(~finite, 0.0), self.head.scale)
        return adjusted.masked_fill(~finite, float("-inf"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.head!r}, scores={self.scores!r})"


def _download(repo_id: str, revision: str | None) -> Path:
    """A Hub repository's calibration files (the Hub cache; offline, whatever it holds)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, allow_patterns=[CALIBRATION_FILE, HEAD_FILE]
            )
        )
    except Exception as err:  # offline without a cache, unknown repo, ...: many classes
        raise FileNotFoundError(
            f"{repo_id!r} is neither a local folder nor a Hub repository whose "
            f"{CALIBRATION_FILE} could be fetched ({type(err).__name__}: {err})"
        ) from err
