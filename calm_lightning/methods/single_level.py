"""Single-level training baselines sharing one loop: regularization, label smoothing and
calibration-aware fine-tuning (CFT). Each differs only in its loss.

One AdamW over every trainable tensor (adapters, and the head when a method has one), linear
warmup then cosine, stepped by the method's own counter; manual optimization so that the
non-finite check happens before any parameter moves, exactly as in CALM.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import move_data_to_device

from calm_lightning.config_rules import Number, OneOf
from calm_lightning.errors import ConfigError
from calm_lightning.methods.objectives import (
    VOCAB,
    adjusted_predictions,
    cross_entropy,
    mean_entropy,
    response_positions,
)
from calm_lightning.methods.training import TrainingMethod, first_non_finite

N_BINS = 10


def confidence_bins(confidence: torch.Tensor, n_bins: int = N_BINS) -> torch.Tensor:
    """Equal-width bin index of each confidence; 1.0 lands in the last bin (as in metrics.py)."""
    return (confidence * n_bins).floor().long().clamp(0, n_bins - 1)


def bin_statistics(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = N_BINS):
    """Per-bin accuracy and count of (confidence, correct) pairs; empty bins have accuracy 0
    and count 0."""
    bins = confidence_bins(confidence, n_bins)
    count = torch.bincount(bins, minlength=n_bins).float()
    hits = torch.bincount(bins, weights=correct.float(), minlength=n_bins)
    return hits / count.clamp(min=1), count


def initial_bin_statistics(batches) -> tuple[list, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From (ids, probs, targets) batches of the initial model: the example id of every
    prediction (one per MCQA example in options mode, one per response token in vocab mode),
    every prediction's bin, and the per-bin accuracy and count."""
    ids, confidence, correct = [], [], []
    for batch_ids, probs, targets in batches:
        top, prediction = probs.max(-1)
        ids += list(batch_ids)
        confidence.append(top.detach().float().cpu())
        correct.append((prediction == targets).cpu())
    confidence_t, correct_t = torch.cat(confidence), torch.cat(correct)
    accuracy, count = bin_statistics(confidence_t, correct_t)
    return ids, confidence_bins(confidence_t), accuracy, count


class Scored(NamedTuple):
    """A training batch scored in a method's mode (`SingleLevelMethod.scored_predictions`)."""

    answer_ce: torch.Tensor | None  # next-token CE of the answer (None unless asked / free)
    logits: torch.Tensor  # (N, K or V) adjusted logits the objective scores
    targets: torch.Tensor  # (N,)
    answer_tokens: int  # tokens answer_ce averages over (0 without it)


class SingleLevelMethod(TrainingMethod):
    """A single-level method: subclasses implement `loss(batch) -> (loss, logs)`."""

    config_rules: ClassVar[dict] = {
        "lr": Number(minimum=0, exclusive_minimum=True),
        "objective": OneOf(("auto", "vocab", "options")),
        "initial_pass_batches": Number(minimum=1, integer=True, optional=True),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        lr: float = 1e-4,
        objective: str = "auto",
        initial_pass_batches: int | None = None,
        warmup_ratio: float = 0.2,
        **kwargs,
    ) -> None:
        super().__init__(model, tokenizer, warmup_ratio=warmup_ratio, **kwargs)
        self.check_arguments(lr=lr, objective=objective, initial_pass_batches=initial_pass_batches)
        self.automatic_optimization = False
        self.initial_pass_batches = initial_pass_batches
        self.lr = float(lr)
        self.objective = objective
        self.mode = VOCAB

    def configure_optimizers(self):
        params = [p for p in self.model.parameters() if p.requires_grad]
        if not params:
            raise ConfigError(f"{type(self).__name__} trains LoRA adapters: use peft=lora")
        optimizer = self.adamw(params, self.lr)
        return [optimizer], [
            torch.optim.lr_scheduler.LambdaLR(optimizer, self.lr_factor_schedule())
        ]

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.mode = self.resolve_mode(self.objective, "train")
        self.set_option_ids(self.mode)

    def scored_predictions(self, batch: dict, answer_ce: bool = False) -> Scored:
        """A training batch in this method's mode. The answer cross-entropy (next-token CE
        over every response token through the head: the answer letter's under letter scoring,
        the answer text's under cloze scoring) comes free with cloze scoring (same forward);
        otherwise it is computed only when `answer_ce` asks."""
        if self.mode == VOCAB:
            raw = self.model.raw_logits(batch["input_ids"], batch["attention_mask"])
            logits, targets = adjusted_predictions(self.model, raw, batch["labels"], VOCAB)
            if not answer_ce:
                return Scored(None, logits, targets, 0)
            return Scored(cross_entropy(logits, targets), logits, targets, targets.numel())
        scores = self.scorer.training_logits(
            self.model, batch, self.option_ids, answer_ce=answer_ce
        )
        return Scored(scores.answer_ce, scores.logits, scores.targets, scores.answer_tokens)

    def loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss to backward and what to log. Under data parallelism each term is weighted
        by `distributed_mean` / `distributed_sum`, so that DDP's averaged gradient is the
        global batch's and the logged values (averaged over ranks) are its values."""
        raise NotImplementedError

    def batch_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one training step's batch (a training batch, or the data module's
        training / held-out pair): `loss` on the training part."""
        return self.loss(batch.get("train", batch))

    def training_step(self, batch: dict, batch_idx: int) -> None:
        loss, logs = self.batch_loss(batch)
        if self.non_finite_anywhere(loss=loss):
            self.fail_non_finite("loss")
        optimizer = self.optimizers()
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if first_non_finite(gradient=grads):
            optimizer.zero_grad(set_to_none=True)
            self.fail_non_finite("gradient")
        optimizer.step()
        self.lr_schedulers().step()
        self.outer_step += 1
        name = type(self).__name__.lower()
        logs = {f"{name}/{k}": v for k, v in logs.items()}
        logs[f"{name}/loss"] = loss.item()
        logs[f"{name}/lr"] = optimizer.param_groups[0]["lr"]
        # sync_dist averages the ranks' weighted values: the global batch's (no-op on one).
        self.log_dict(logs, on_step=True, on_epoch=False, sync_dist=True)
        self.log("loss", loss.item(), prog_bar=True, logger=False, on_step=True, on_epoch=False)

    @torch.no_grad()
    def initial_predictions(self):
        """Yield (ids, probabilities, targets) of the untouched model over the training
        split in a fixed order (one pass, as LS and CFT need before training); at most
        `initial_pass_batches` batches when set. `ids` names each prediction's example: in
        vocab mode an example's id repeats once per response token, in token order."""
        datamodule = self.trainer.datamodule
        was_training = self.model.training
        self.model.eval()
        try:
            for index, batch in enumerate(datamodule.ordered_train_dataloader()):
                if self.initial_pass_batches is not None and index >= self.initial_pass_batches:
                    break
                batch = move_data_to_device(batch, self.device)
                _, logits, targets, _ = self.scored_predictions(batch)
                ids = list(batch["ids"])
                if self.mode == VOCAB:
                    counts = response_positions(batch["labels"]).sum(1).tolist()
                    ids = [i for i, n in zip(ids, counts, strict=True) for _ in range(n)]
                yield ids, logits.float().softmax(-1), targets
        finally:
            self.model.train(was_training)


ENTROPY_ON = ("train", "heldout")


class Regularization(SingleLevelMethod):
    """L = CE(y, p) - alpha_reg * H(p): the entropy objective as a single-level penalty.

    `entropy_on`: `train` (the paper's baseline) takes H on the training batch's predictions;
    `heldout` on the paired held-out batch, in the mode CALM's upper level would read it
    (`objective` resolved on the held-out split; its labels only locate the responses). With
    alpha_reg = 1 / lambda, one step of the latter moves the adapters as one outer step of CALM
    with its head frozen (docs/studies/entropy_equivalence.md)."""

    config_rules: ClassVar[dict] = {"alpha_reg": Number(minimum=0), "entropy_on": OneOf(ENTROPY_ON)}

    def __init__(
        self, model, tokenizer=None, alpha_reg: float = 1e-5, entropy_on: str = "train", **kwargs
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.check_arguments(alpha_reg=alpha_reg, entropy_on=entropy_on)
        self.alpha_reg = float(alpha_reg)
        self.entropy_on = entropy_on
        self.entropy_mode = VOCAB  # the held-out batch's mode, resolved in on_fit_start

    @classmethod
    def check_requirements(cls, cfg, sources: dict) -> None:
        super().check_requirements(cfg, sources)
        module = cfg.get("method", {}).get("module", {}) or {}
        if module.get("entropy_on") == "heldout" and sources.get("heldout") is None:
            raise ConfigError(
                f"method={cfg.method.name} with method.module.entropy_on=heldout needs held-out "
                f"data, which setting={cfg.setting.name} does not define (setting.heldout); "
                "use entropy_on=train"
            )

    def on_fit_start(self) -> None:
        super().on_fit_start()
        if self.entropy_on == "heldout":
            self.entropy_mode = self.resolve_mode(self.objective, "heldout")
            self.set_option_ids(self.mode, self.entropy_mode)

    def batch_loss(self, batch: dict) -> tuple[torch.Tensor, dict[str, float]]:
        if self.entropy_on == "train":
            return super().batch_loss(batch)
        if "heldout" not in batch:
            raise ConfigError(
                "reg with entropy_on=heldout got a training batch without its held-out batch: "
                "the setting needs held-out data (setting.heldout)"
            )
        return self.loss(batch["train"], heldout=batch["heldout"])

    def loss(self, batch, heldout: dict | None = None):
        """CE on `batch` minus alpha_reg times the mean entropy on `heldout` when given (in
        `entropy_mode`), else on `batch`'s own predictions."""
        answer_ce, logits, targets, answer_tokens = self.scored_predictions(batch)
        # Letter scoring: CE of the option letters; cloze scoring: CE of the answer text, with
        # the entropy of the cloze option distribution.
        if answer_ce is None:
            answer_ce, answer_tokens = cross_entropy(logits, targets), targets.numel()
        ce = self.distributed_mean(answer_ce, answer_tokens)
        if heldout is not None:  # CALM's upper-level inputs: its entropy pass, exactly
            logits, _ = self.scored(heldout, self.entropy_mode)
        entropy = self.distributed_mean(mean_entropy(logits), logits.shape[0])
        return ce - self.alpha_reg * entropy, {"ce": ce.item(), "entropy": entropy.item()}


def smoothed_targets(answer: torch.Tensor, accuracy: torch.Tensor, n_options: int) -> torch.Tensor:
    """Soft labels: the gold option gets `accuracy`, the rest 1 - accuracy spread uniformly."""
    rest = (1 - accuracy) / (n_options - 1)
    targets = rest[:, None].expand(-1, n_options).clone()
    targets.scatter_(1, answer[:, None], accuracy[:, None])
    return targets


def soft_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return -(targets * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()


class LabelSmoothing(SingleLevelMethod):
    """Label smoothing with a per-sample epsilon from the initial model's confidence bin:
    a prediction whose initial confidence falls in bin b has eps = 1 - acc_b (acc_b: the
    initial model's accuracy in that bin over the training set).

    On MCQA data a prediction is the answer letter (K-way); on instruction / open-QA data it
    is each response token's next-token distribution (V-way, the gold token keeps 1 - eps and
    eps is spread uniformly over the rest of the vocabulary), binned per token.
    """

    train_kinds = ("mcqa", "openqa")
    train_kinds_reason = (
        "label smoothing needs MCQA training data (setting=id) or open-ended QA "
        "(setting=gen_ood); the paper drops it for Alpaca because Alpaca turned into MCQA "
        "always has answer A"
    )

    def on_fit_start(self) -> None:
        super().on_fit_start()
        self.initial_pass_batches = None  # every training prediction needs its own bin
        ids, bins, self.bin_accuracy, _ = initial_bin_statistics(self.initial_predictions())
        # In order: one entry per MCQA example, or one per response token of each example.
        self.sample_accuracy: dict[str, list[float]] = {}
        for i, b in zip(ids, bins.tolist(), strict=True):
            self.sample_accuracy.setdefault(i, []).append(float(self.bin_accuracy[b]))

    def _accuracy_of(self, batch: dict, n_predictions: int, device) -> torch.Tensor:
        values = [a for i in batch["ids"] for a in self.sample_accuracy[i]]
        if len(values) != n_predictions:
            raise RuntimeError(
                f"label smoothing: {n_predictions} predictions in the batch but {len(values)} "
                "binned by the initial pass (the collation changed between the passes)"
            )
        return torch.tensor(values, device=device, dtype=torch.float32)

    def loss(self, batch):
        _, logits, targets, _ = self.scored_predictions(batch)
        accuracy = self._accuracy_of(batch, logits.shape[0], logits.device)
        if self.mode == VOCAB:
            loss = smoothed_vocab_cross_entropy(logits, targets, accuracy)
        else:  # the option distribution: K-way soft labels
            soft = smoothed_targets(targets, accuracy, logits.shape[-1])
            loss = soft_cross_entropy(logits, soft)
        eps = self.distributed_mean((1 - accuracy).mean(), logits.shape[0])
        return self.distributed_mean(loss, logits.shape[0]), {"mean_eps": float(eps)}


def smoothed_vocab_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, keep: torch.Tensor
) -> torch.Tensor:
    """Cross-entropy against soft labels over the whole vocabulary without building them: the
    gold token has probability `keep`, every other token (1 - keep) / (V - 1)."""
    log_p = F.log_softmax(logits.float(), dim=-1)
    gold = log_p.gather(1, targets[:, None]).squeeze(1)
    rest = (log_p.sum(-1) - gold) / (logits.shape[-1] - 1)
    return -(keep * gold + (1 - keep) * rest).mean()


def cft_targets(rest: torch.Tensor, accuracy: torch.Tensor) -> torch.Tensor:
    """Targets for the non-max probabilities (sorted descending, shape (N, K - 1)): they sum to
    1 - acc and grow monotonically with the current probabilities,
    t_j proportional to 1 + tanh(gamma p_j), gamma = ln(K - 1) / (p_(2) (1 - acc))."""
    k = rest.shape[-1] + 1
    gamma = math.log(k - 1) / (rest[:, 0] * (1 - accuracy)).clamp(min=1e-6)
    weights = 1 + torch.tanh(gamma[:, None] * rest)
    return (1 - accuracy)[:, None] * weights / weights.sum(-1, keepdim=True)


def cft_calibration_loss(
    probs: torch.Tensor, bin_accuracy: torch.Tensor, bin_count: torch.Tensor
) -> torch.Tensor:
    """CFT's L_cal: over the bins of the current top probability,
    sum_k (1/N_k) [sum_i (p_max,i - acc_k)^2 + sum_i sum_{j>=2} (p_(j),i - t_(j),i)^2]
    with acc_k, N_k frozen from the initial model (targets are constants)."""
    ordered, _ = probs.sort(dim=-1, descending=True)
    top, rest = ordered[:, 0], ordered[:, 1:]
    bins = confidence_bins(top.detach())
    accuracy, count = bin_accuracy[bins], bin_count[bins].clamp(min=1)
    targets = cft_targets(rest.detach(), accuracy)
    per_sample = (top - accuracy) ** 2 + ((rest - targets) ** 2).sum(-1)
    return (per_sample / count).sum()


class CFT(SingleLevelMethod):
    """Calibration-aware fine-tuning: (1 - w) L_SFT + w c L_cal (c = 1e-3).

    L_SFT is next-token cross-entropy on every response token. L_cal acts on the method's
    prediction distributions: the option letters for MCQA data, and for instruction / open QA
    data each response position's full next-token distribution (a V-way classification whose
    per-bin accuracy is the initial model's top-1 next-token accuracy).
    """

    config_rules: ClassVar[dict] = {
        "weight": Number(minimum=0, maximum=1),
        "scale": Number(minimum=0),
    }

    def __init__(
        self, model, tokenizer=None, weight: float = 0.5, scale: float = 1e-3, **kwargs
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.check_arguments(weight=weight, scale=scale)
        self.weight = float(weight)
        self.scale = float(scale)

    def on_fit_start(self) -> None:
        super().on_fit_start()
        _, _, accuracy, count = initial_bin_statistics(self.initial_predictions())
        # A bin the initial model never reached has no accuracy; its centre stands in (no pull).
        centres = (torch.arange(N_BINS) + 0.5) / N_BINS
        self.bin_accuracy = torch.where(count > 0, accuracy, centres).to(self.device)
        self.bin_count = count.to(self.device)

    def loss(self, batch):
        sft, logits, _, sft_tokens = self.scored_predictions(batch, answer_ce=True)
        sft = self.distributed_mean(sft, sft_tokens)
        # L_cal sums over the batch's predictions (each bin's term / its frozen count).
        cal = self.distributed_sum(
            cft_calibration_loss(logits.float().softmax(-1), self.bin_accuracy, self.bin_count)
        )
        loss = (1 - self.weight) * sft + self.weight * self.scale * cal
        return loss, {"sft": sft.item(), "cal": cal.item()}
