"""Label-free temperature fitting against a pre-trained reference model (PLM): DACA and
Dual-Align (docs/posthoc.md).

Everything here works on option logits from the logit lens, shaped (N, L, K): N questions,
L layers (the last one is the model's own output), K options. The post-trained model (PoLM)
is `f`, the reference PLM is `g`. Divergences are in nats, so a Jensen-Shannon divergence lies
in [0, ln 2].

Dual-Align has no public code; every choice this reconstruction makes is an argument here and
a config field in `conf/method/dual_align.yaml`, and is listed in docs/fidelity.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

PARAMETERISATIONS = ("log", "direct")
ISE_TEMPERED = ("all", "final")
# Dual-Align's per-sample mixing weight w, each a divergence in [0, ln 2] divided by ln 2:
# peak_jump = max(d_l* - d_(l*-1), 0) (the paper's Delta D_JS^l*, the default), peak = d_l*,
# final = d_L.
WEIGHTS = ("peak_jump", "peak", "final")
_EPS = 1e-12


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy (nats) over the last dimension; 0 log 0 = 0."""
    return -(probs * torch.log(probs.clamp_min(_EPS))).sum(-1)


def kl_divergence(p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats over the last dimension, q given as log-probabilities."""
    return (p * (torch.log(p.clamp_min(_EPS)) - log_q)).sum(-1)


def jensen_shannon(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """JSD(p || q) = H(m) - (H(p) + H(q)) / 2 with m = (p + q) / 2, in nats (max ln 2)."""
    return entropy((p + q) / 2) - (entropy(p) + entropy(q)) / 2


def layer_divergence(plm_logits: torch.Tensor, polm_logits: torch.Tensor) -> torch.Tensor:
    """d_l(x) = JSD(p_g^l || p_f^l) for every layer: (N, L, K) logits -> (N, L)."""
    if plm_logits.shape != polm_logits.shape:
        raise ValueError(
            f"PLM and PoLM lens logits differ in shape: {tuple(plm_logits.shape)} vs "
            f"{tuple(polm_logits.shape)} (the two models need the same number of layers)"
        )
    return jensen_shannon(plm_logits.softmax(-1), polm_logits.softmax(-1))


def peak_divergence_layer(divergence: torch.Tensor, min_layer: int = 2) -> torch.Tensor:
    """l* = argmax_{l >= min_layer} (d_l - d_{l-1}) per sample, as a 0-based layer index.

    The signed increase, as the paper's "layer with the maximum JSD increase": a drop in
    divergence (the two models re-converging) never outranks a rise. Layers are numbered from 1
    in the formula, so `min_layer = 2` (the default) compares every layer with the one before
    it. Ties go to the earliest layer. A sample whose divergence never increases still gets the
    argmax, i.e. the layer of the smallest fall (or of a zero change), earliest on ties; its
    `peak_jump` weight is then 0 (`divergence_weight`). With one layer, l* = 0.
    """
    n_layers = divergence.shape[-1]
    if n_layers < 2:
        return torch.zeros(divergence.shape[:-1], dtype=torch.long, device=divergence.device)
    jumps = divergence[..., 1:] - divergence[..., :-1]  # jumps[i] is layer i + 2 (1-based)
    first = max(min_layer, 2) - 2
    if first >= jumps.shape[-1]:
        raise ValueError(f"min_layer={min_layer} leaves no layer out of {n_layers}")
    # torch.argmax returns the first maximal index, so ties go to the earliest layer.
    return jumps[..., first:].argmax(-1) + first + 1


def divergence_weight(
    divergence: torch.Tensor, peak: torch.Tensor, weight: str = "peak_jump"
) -> torch.Tensor:
    """Dual-Align's mixing weight w in [0, 1] from the per-layer JSD d (N, L) and l* (N,).

    `peak_jump`: max(d_l* - d_(l*-1), 0) / ln 2, the signed divergence increase that selected
    l* (the paper's Delta D_JS^l*(x)), 0 for a sample whose divergence never increases; with
    l* = 0 (a single layer) the increase is taken from 0, i.e. d_0.
    `peak`: d_l* / ln 2. `final`: d_L / ln 2. Every d lies in [0, ln 2], so each quantity does
    too and dividing by ln 2 maps it onto [0, 1] with no data-dependent scale; the clamp only
    absorbs rounding.
    """
    if weight not in WEIGHTS:
        raise ValueError(f"weight={weight!r} is not one of {WEIGHTS}")
    rows = torch.arange(divergence.shape[0], device=divergence.device)
    if weight == "final":
        value = divergence[:, -1]
    elif weight == "peak":
        value = divergence[rows, peak]
    else:
        before = torch.where(peak > 0, divergence[rows, (peak - 1).clamp_min(0)], 0.0)
        value = (divergence[rows, peak] - before).clamp_min(0.0)
    return (value / math.log(2)).clamp(0.0, 1.0)


def inferential_stability_entropy(probs: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """ISE(x) = H(mean_{l >= l*(x)} p^l(x)): probs (N, L, K), start (N,) 0-based -> (N,)."""
    layers = torch.arange(probs.shape[1], device=probs.device)
    keep = (layers[None, :] >= start[:, None]).to(probs.dtype)  # (N, L)
    mean = (probs * keep[..., None]).sum(1) / keep.sum(1, keepdim=True)
    return entropy(mean)


def agreement_mask(plm_final: torch.Tensor, polm_final: torch.Tensor) -> torch.Tensor:
    """DACA's mask: the two models' top options agree (first index on ties)."""
    return plm_final.argmax(-1) == polm_final.argmax(-1)


def daca_loss(
    polm_final: torch.Tensor, plm_probs: torch.Tensor, mask: torch.Tensor, temperature
) -> torch.Tensor:
    """(1/B) sum_i m_i CE(p_g,i, softmax(z_f,i / T)): divided by the whole batch B, not by
    the number of agreeing samples, as the DACA reference does."""
    log_q = torch.log_softmax(polm_final / temperature, -1)
    per_sample = -(plm_probs * log_q).sum(-1)
    return (per_sample * mask.to(per_sample.dtype)).sum() / polm_final.shape[0]


@dataclass
class DualAlignTargets:
    """What Dual-Align needs from the PLM and the untempered models, computed once."""

    plm_final_probs: torch.Tensor  # (N, K)
    plm_ise: torch.Tensor  # (N,)
    peak_layer: torch.Tensor  # (N,) 0-based
    weight: torch.Tensor  # (N,) w in [0, 1] (`divergence_weight`)


def dual_align_targets(
    plm_logits: torch.Tensor,
    polm_logits: torch.Tensor,
    min_layer: int = 2,
    weight: str = "peak_jump",
) -> DualAlignTargets:
    """Per-sample PLM references, peak divergence layer and divergence weight."""
    divergence = layer_divergence(plm_logits, polm_logits)
    peak = peak_divergence_layer(divergence, min_layer)
    plm_probs = plm_logits.softmax(-1)
    return DualAlignTargets(
        plm_final_probs=plm_probs[:, -1],
        plm_ise=inferential_stability_entropy(plm_probs, peak),
        peak_layer=peak,
        weight=divergence_weight(divergence, peak, weight),
    )


def dual_align_loss(
    polm_logits: torch.Tensor,
    targets: DualAlignTargets,
    temperature,
    ise_tempered: str = "all",
    components: tuple[bool, bool] = (True, True),
) -> torch.Tensor:
    """mean[(1 - w) KL(p_g^L || softmax(z_f^L / T)) + w (ISE_g - ISE_f(T))^2].

    `ise_tempered`: divide every lens layer of the PoLM by T inside ISE_f (`all`) or only the
    final one (`final`). `components` switches the confidence / process terms (ablations).
    """
    if ise_tempered not in ISE_TEMPERED:
        raise ValueError(f"ise_tempered={ise_tempered!r} is not one of {ISE_TEMPERED}")
    w = targets.weight.to(polm_logits.dtype)
    final = polm_logits[:, -1] / temperature
    loss = torch.zeros((), dtype=polm_logits.dtype, device=polm_logits.device)
    if components[0]:
        conf = kl_divergence(targets.plm_final_probs, torch.log_softmax(final, -1))
        loss = loss + ((1 - w) * conf).mean()
    if components[1]:
        if ise_tempered == "all":
            tempered = polm_logits / temperature
        else:
            tempered = torch.cat([polm_logits[:, :-1], final[:, None]], dim=1)
        ise_f = inferential_stability_entropy(tempered.softmax(-1), targets.peak_layer)
        loss = loss + (w * (targets.plm_ise - ise_f) ** 2).mean()
    return loss


@dataclass
class TemperatureFitResult:
    temperature: float
    loss_before: float  # full-data loss at T = 1
    loss_after: float  # full-data loss at the fitted T
    steps: int  # Adam steps taken


def fit_temperature_adam(
    loss_fn,
    n: int,
    lr: float = 0.05,
    epochs: int = 300,
    batch_size: int = 128,
    init: float = 1.0,
    parameterisation: str = "log",
    seed: int = 0,
) -> TemperatureFitResult:
    """Fit one temperature with Adam over shuffled mini-batches.

    `loss_fn(index, T)` returns the loss of the samples `index` (a LongTensor) at temperature
    T (a 0-d tensor carrying the gradient). `parameterisation` `log` optimises log T (T stays
    positive), `direct` optimises T itself (clamped at 1e-3).
    """
    if parameterisation not in PARAMETERISATIONS:
        raise ValueError(f"parameterisation={parameterisation!r} is not one of {PARAMETERISATIONS}")
    if n < 1:
        raise ValueError("cannot fit a temperature on zero samples")
    start = math.log(init) if parameterisation == "log" else init
    param = torch.nn.Parameter(torch.tensor(start, dtype=torch.float64))
    optimizer = torch.optim.Adam([param], lr=lr)

    def temperature() -> torch.Tensor:
        return param.exp() if parameterisation == "log" else param.clamp_min(1e-3)

    everything = torch.arange(n)
    generator = torch.Generator().manual_seed(seed)
    steps = 0
    # Thousands of steps on small CPU tensors: with several intra-op threads each op pays a
    # thread hand-off (~16 ms a step on a busy 2-core machine against ~0.1 ms on one thread).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            before = float(loss_fn(everything, torch.tensor(init, dtype=torch.float64)))
        for _ in range(epochs):
            for index in torch.randperm(n, generator=generator).split(batch_size):
                optimizer.zero_grad()
                loss = loss_fn(index, temperature())
                if loss.requires_grad:
                    loss.backward()
                    optimizer.step()
                steps += 1
        with torch.no_grad():
            after = float(loss_fn(everything, temperature()))
    finally:
        torch.set_num_threads(threads)
    return TemperatureFitResult(float(temperature().detach()), before, after, steps)
