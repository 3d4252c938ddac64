"""A per-token head with a support: one shared temperature plus entries on chosen tokens only.

    z'_y = d0 * d_y * z_y + l_y   for y in the support S
    z'_y = d0 * z_y               elsewhere

d0 is the shared scale (the scalar head's `scale`, trained as log d0 by default: a temperature),
l_y (`bias`, size |S|) the per-token biases and, optionally, d_y = exp(s_y) (`token_log_scale`)
per-token scales. With every entry at zero it is a temperature, so it contains temperature
scaling; with d0 = 1 and the entries at zero it is the identity.

Why a support (docs/calm.md, "A per-token head"): the paper's vector head gives every one of the
vocabulary's entries its own (d, l), and almost all of them see no gradient signal worth the
name; the entries that the scored distribution reads are the option tokens. The support is
set from the data before training (`set_support`), so the parameters' sizes are known before
the optimizers and a checkpoint are built.

After training the head is turned into the equivalent dense vector head (`to_vector`): saved
files, evaluation and exports then see an ordinary `LogitAdjustment` of kind `vector`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from calm_lightning.models.logit_adjustment import LogitAdjustment


class TokenLogitAdjustment(LogitAdjustment):
    """A scalar head (d0) plus per-token entries on a support of token ids."""

    def __init__(
        self,
        vocab_size: int,
        center: str = "none",
        parameterization: str = "log",
        token_scale: bool = False,
        support: Sequence[int] = (),
    ) -> None:
        super().__init__(
            vocab_size, kind="scalar", center=center, parameterization=parameterization
        )
        self.kind = "token"
        self.token_scale = bool(token_scale)
        self.register_buffer("support", torch.zeros(0, dtype=torch.long), persistent=False)
        self.set_support(support)

    def set_support(self, token_ids: Sequence[int]) -> None:
        """Replace the support and reset its entries to the identity (l = 0, d_y = 1)."""
        ids = sorted({int(i) for i in token_ids})
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"support token ids {bad[:5]} are outside the vocabulary (0..."
                             f"{self.vocab_size - 1})")  # fmt: skip
        device = self.scale.device
        self.support = torch.tensor(ids, dtype=torch.long, device=device)
        # Registered after the shared scale, in the order d0, (s_y), l: CALM's logs read the
        # head's entry -2 as its scale and -1 as its bias.
        for name in ("token_log_scale", "bias"):
            if name in self._parameters:
                del self._parameters[name]
        if self.token_scale:
            self.token_log_scale = nn.Parameter(torch.zeros(len(ids), device=device))
        self.bias = nn.Parameter(torch.zeros(len(ids), device=device))

    def token_parameters(self) -> list[nn.Parameter]:
        """The per-token entries (l, and s when `token_scale`)."""
        return [p for n, p in self.named_parameters() if n in ("token_log_scale", "bias")]

    def shared_parameters(self) -> list[nn.Parameter]:
        """The shared scale d0 (as log d0 or d0)."""
        return [p for n, p in self.named_parameters() if n in ("log_scale", "scale")]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, l) over the whole vocabulary, differentiable in every entry."""
        d0 = self.scale
        d = d0.expand(self.vocab_size)
        if self.token_scale:
            s = torch.zeros(self.vocab_size, device=d0.device).index_add(
                0, self.support, self.token_log_scale
            )
            d = d * s.exp()
        bias = torch.zeros(self.vocab_size, device=d0.device).index_add(0, self.support, self.bias)
        return d, bias

    def entries(self) -> tuple[torch.Tensor, torch.Tensor, bool]:
        return (*self.dense(), True)

    def to_vector(self) -> LogitAdjustment:
        """The same function as a plain vector head (linear d), for evaluation and exports."""
        head = LogitAdjustment(self.vocab_size, kind="vector", center=self.center)
        d, bias = self.dense()
        with torch.no_grad():
            head.scale.copy_(d.detach())
            head.bias.copy_(bias.detach())
        return head.to(self.scale.device)

    def save(self, directory: str | Path) -> Path:
        return self.to_vector().save(directory)

    def summary(self) -> dict[str, float]:
        l_ = self.bias.detach().float()
        out = {
            "d_mean": float(self.scale.detach().mean()),
            "d_std": 0.0,
            "l_mean": float(l_.mean()) if l_.numel() else 0.0,
            "l_std": float(l_.std()) if l_.numel() > 1 else 0.0,
            "l_abs_max": float(l_.abs().max()) if l_.numel() else 0.0,
        }
        if self.token_scale and l_.numel() > 1:
            out["d_std"] = float((self.scale.detach() * self.token_log_scale.detach().exp()).std())
        return out

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, support={self.support.numel()}, "
            f"token_scale={self.token_scale}, center={self.center}, "
            f"parameterization={self.parameterization}"
        )
