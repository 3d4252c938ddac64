"""The logit-adjustment ("calibration") head: z'_y = d_y * (z_y - c) + l_y.

d (`scale`) and l (`bias`) have vocabulary size (`vector`, the paper) or size 1 (`scalar`, a
learned temperature + bias, the paper's ablation). Init d = 1, l = 0 is the identity. With
`center` != none, c is a per-position offset (logsumexp or mean of the logits) so that d acts
like an inverse temperature rather than a per-token bias (raw logits at an answer position
sit around 33 on the embedded model: a 0.01 change of d_y moves z'_y by ~0.3).

`parameterization` = `log` trains s = log d instead of d (d = exp(s) > 0): an optimizer step
of a given size changes d by a factor, not by an amount, so the travel from d = 1 to 1/k
costs ln k whatever k is, and d can never cross 0 (a departure from the paper, which trains
d itself; docs/calm.md, "CALM with a stopping point"). Saved files always hold d.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

KINDS = ("vector", "scalar")
CENTERS = ("none", "logsumexp", "mean")
PARAMETERIZATIONS = ("linear", "log")
HEAD_FILE = "logit_adjustment.safetensors"


class LogitAdjustment(nn.Module):
    """Per-vocabulary (or scalar) affine adjustment of next-token logits."""

    def __init__(
        self,
        vocab_size: int,
        kind: str = "vector",
        center: str = "none",
        parameterization: str = "linear",
    ) -> None:
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"head kind {kind!r} is not one of {KINDS}")
        if center not in CENTERS:
            raise ValueError(f"head center {center!r} is not one of {CENTERS}")
        if parameterization not in PARAMETERIZATIONS:
            raise ValueError(
                f"head parameterization {parameterization!r} is not one of {PARAMETERIZATIONS}"
            )
        self.vocab_size = int(vocab_size)
        self.kind = kind
        self.center = center
        self.parameterization = parameterization
        size = self.vocab_size if kind == "vector" else 1
        # fp32 whatever the LM's dtype: these are the calibration parameters themselves. The
        # scale comes first in `named_parameters` in both forms (logs read it as entry -2).
        if parameterization == "log":
            self.log_scale = nn.Parameter(torch.zeros(size, dtype=torch.float32))  # s = log d
        else:
            self.register_parameter("scale", nn.Parameter(torch.ones(size, dtype=torch.float32)))
        self.bias = nn.Parameter(torch.zeros(size, dtype=torch.float32))  # l

    @property
    def scale(self) -> torch.Tensor:
        """d: the parameter itself (`linear`) or exp(s) (`log`, a differentiable function of s;
        writing into it changes nothing there)."""
        if self.parameterization == "log":
            return self.log_scale.exp()
        if "scale" not in self._parameters:  # while __init__ registers it
            raise AttributeError("scale")
        return self._parameters["scale"]

    def forward(self, logits: torch.Tensor, token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Adjust logits of shape (..., V); with `token_ids`, return only those columns.

        Selecting columns after centering keeps the offset c a full-vocabulary statistic, so
        restricting to the option letters gives the same numbers as adjusting everything.
        """
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(
                f"logits have {logits.shape[-1]} entries but the head was built for "
                f"{self.vocab_size} (vocabulary mismatch between model and head)"
            )
        z = logits.float()
        if self.center == "logsumexp":
            z = z - torch.logsumexp(z, dim=-1, keepdim=True)
        elif self.center == "mean":
            z = z - z.mean(dim=-1, keepdim=True)
        scale, bias, per_token = self.entries()
        if token_ids is not None:
            z = z.index_select(-1, token_ids)
            if per_token:
                scale, bias = scale.index_select(0, token_ids), bias.index_select(0, token_ids)
        # One fused op: z * scale + bias would keep an extra (N, V) intermediate alive.
        return torch.addcmul(bias, z, scale)

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """(d, l, whether they have one entry per vocabulary id) as forward applies them."""
        return self.scale, self.bias, self.kind == "vector"

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, kind={self.kind}, center={self.center}, "
            f"parameterization={self.parameterization}"
        )

    def save(self, directory: str | Path) -> Path:
        """Write d and l and their shape/kind next to an adapter (d, not s, for a log head:
        what the head computes is all an export or an evaluation needs)."""
        path = Path(directory) / HEAD_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {"scale": self.scale.detach().cpu(), "bias": self.bias.detach().cpu()}
        meta = {"vocab_size": str(self.vocab_size), "kind": self.kind, "center": self.center,
                "parameterization": self.parameterization}  # fmt: skip
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, directory: str | Path) -> LogitAdjustment:
        """Rebuild a head saved by `save`, bit-identical (as a `linear` head holding the saved d:
        the parameterization only matters while training)."""
        path = Path(directory) / HEAD_FILE
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata()
        head = cls(int(meta["vocab_size"]), kind=meta["kind"], center=meta["center"])
        tensors = load_file(str(path))
        with torch.no_grad():
            head.scale.copy_(tensors["scale"])
            head.bias.copy_(tensors["bias"])
        return head

    def summary(self) -> dict[str, float]:
        """Mean and spread of d and l, for logs."""
        d, l_ = self.scale.detach().float(), self.bias.detach().float()
        return {
            "d_mean": d.mean().item(),
            "d_std": d.std().item() if d.numel() > 1 else 0.0,
            "l_mean": l_.mean().item(),
            "l_std": l_.std().item() if l_.numel() > 1 else 0.0,
        }
