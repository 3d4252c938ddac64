"""`CalibrationLogitsProcessor`: an exported model's calibration as a transformers
`LogitsProcessor`, so `model.generate(..., logits_processor=[processor])` and the
text-generation pipeline sample from the calibrated distribution with plain transformers.

Only torch, safetensors and transformers are imported here (no Lightning, no Hydra): a user
of an exported folder needs nothing else from this project. The folder format is described in
docs/export.md; `python -m calm_lightning.export` writes it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LogitsProcessor

from calm_lightning.models.logit_adjustment import HEAD_FILE, LogitAdjustment

CALIBRATION_FILE = "calibration.json"  # what the calibration is: formula, method, prompt format


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
    """

    def __init__(self, head: LogitAdjustment | None) -> None:
        self.head = None if head is None else head.eval().requires_grad_(False)

    @classmethod
    def from_pretrained(cls, folder: str | Path) -> CalibrationLogitsProcessor:
        """The processor of an exported folder (its calibration head, or the identity)."""
        folder = Path(folder)
        info = read_calibration(folder)
        if info.get("head") is None:
            return cls(None)
        if info["head"].get("file", HEAD_FILE) != HEAD_FILE:
            raise ValueError(f"{folder}: the head file must be named {HEAD_FILE}")
        return cls(LogitAdjustment.load(folder))

    @property
    def temperature(self) -> float | None:
        """T for a pure temperature head (scalar d, l = 0, no centering), else None."""
        head = self.head
        if head is None or head.kind != "scalar" or head.center != "none" or head.bias.item():
            return None
        return 1.0 / head.scale.item()

    @torch.no_grad()
    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return scores
        if self.head.scale.device != scores.device:
            self.head.to(scores.device)
        finite = torch.isfinite(scores)
        if bool(finite.all()):
            return self.head(scores)
        # An earlier processor masked some tokens (-inf): centre on the tokens still allowed
        # (a mean over -inf is undefined) and keep the masked ones masked.
        z = scores.float()
        allowed = z.masked_fill(~finite, 0.0)
        if self.head.center == "logsumexp":
            z = z - torch.logsumexp(z, dim=-1, keepdim=True)
        elif self.head.center == "mean":
            count = finite.sum(-1, keepdim=True).clamp(min=1)
            z = z - allowed.sum(-1, keepdim=True) / count
        adjusted = torch.addcmul(self.head.bias, z.masked_fill(~finite, 0.0), self.head.scale)
        return adjusted.masked_fill(~finite, float("-inf"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.head!r})"
