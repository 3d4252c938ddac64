"""The method protocol and the shared test loop.

Every method is a `CalibrationMethod` (a LightningModule). The pipeline knows only this
protocol (docs/architecture.md):

* class attributes state what the method needs, checked before any model is loaded
  (`check_requirements`): adapters, a logit-adjustment head, held-out data, a reference model,
  the kind of training data;
* `build_model` wraps the loaded LM into the `CalibratedLM` the method works on;
* `calibrate(trainer, datamodule, ckpt_path)` does whatever the method does before evaluation
  (nothing for `base`, `Trainer.fit` for training methods, a fit on held-out data for post-hoc
  temperatures) and returns what it fitted, for metrics.json;
* evaluation is shared: MCQA option scoring, or sampling + Sem-ECE when the test split is
  open-ended QA. Methods that produce their confidence differently override
  `option_probabilities` and nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device

from calm_lightning.data.records import OpenQARecord
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.mcqa import OptionTokens
from calm_lightning.evaluation.openqa import OpenQAPredictions, OpenQASettings, score_openqa_batch
from calm_lightning.evaluation.results import mcqa_evaluation, plot_mcqa_reliability
from calm_lightning.evaluation.scorers import MCQAScorer, scorer_from_config
from calm_lightning.metrics.calibration import calibration_report
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import wrap_with_lora
from calm_lightning.runtime.config_checks import check_values, merged_rules
from calm_lightning.runtime.distributed import gather_objects, world

# `head` values: no head, the method's configured head (`method.head`: kind, center), or one
# scalar temperature d = 1 / T over the untouched logits (post-hoc temperature methods).
HEAD_NONE, HEAD_CONFIGURED, HEAD_TEMPERATURE = None, "configured", "temperature"
TEMPERATURE_HEAD = {"kind": "scalar", "center": "none"}


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


class CalibrationMethod(L.LightningModule):
    """Holds the calibrated LM, calibrates it (`calibrate`) and scores test batches."""

    # ----- what the method needs (checked before any model is loaded) -----
    uses_adapter: ClassVar[bool] = False  # attach the `peft` group's adapters
    head: ClassVar[str | None] = HEAD_NONE  # HEAD_NONE | HEAD_CONFIGURED | HEAD_TEMPERATURE
    needs_heldout: ClassVar[bool] = False  # the setting must define held-out data
    needs_reference_model: ClassVar[bool] = False  # a pre-trained reference model is required
    train_kinds: ClassVar[tuple[str, ...] | None] = None  # allowed training-data kinds; None = any
    train_kinds_reason: ClassVar[str] = ""  # shown when the training data is of another kind
    # Whether `calibrate` changes the model: the run then scores the untouched model first
    # (the base row) and saves what changed under calibration/.
    changes_model: ClassVar[bool] = False
    # The MCQA scorers (evaluation/scorers.py) the method works with, and why not cloze
    # (option-likelihood scoring) when it does not (shown with the refusal, before any model
    # loads).
    scorers: ClassVar[tuple[str, ...]] = ("letter",)
    cloze_refusal: ClassVar[str] = ""

    def __init__(
        self,
        model: CalibratedLM,
        tokenizer=None,
        option_tokens: str = "auto",
        probe_size: int = 8,
        n_bins: int = 10,
        openqa: OpenQASettings | dict | None = None,
        scoring: MCQAScorer | str = "letter",
        cloze: dict | None = None,
    ) -> None:
        """`scoring`: the MCQA scorer (the pipeline builds it once from `evaluation`), or its
        name, then built here from `option_tokens`, `probe_size` and `cloze` (direct use)."""
        super().__init__()
        if not isinstance(scoring, MCQAScorer):
            scoring = scorer_from_config(
                {
                    "scoring": scoring,
                    "cloze": cloze,
                    "option_tokens": option_tokens,
                    "probe_size": probe_size,
                }
            )
        self.scorer = scoring
        self.model = model
        self.tokenizer = tokenizer
        self.n_bins = n_bins
        self.option_tokens: OptionTokens | None = None
        self.predictions: MCQAPredictions | OpenQAPredictions | None = None
        self.openqa = (
            openqa if isinstance(openqa, OpenQASettings) else OpenQASettings(**(openqa or {}))
        )
        self._test_rows: list = []
        self._acc_norm_rows: list = []
        self._open_ended = False

    # ----- evaluation (shared) -----
    def _test_loader(self):
        loader = self.trainer.test_dataloaders
        return loader[0] if isinstance(loader, list | tuple) else loader

    def probe_batch(self, size: int) -> dict | None:
        """The first `size` test questions as one batch (for choosing the option tokens)."""
        loader = self._test_loader()
        records = [loader.dataset[i] for i in range(min(size, len(loader.dataset)))]
        if not records:
            return None
        return move_data_to_device(loader.collate_fn(records), self.device)

    @property
    def eval_max_length(self) -> int | None:
        """The setting's longest MCQA prompt (the fitted data module's), None without one."""
        return getattr(getattr(self._trainer, "datamodule", None), "eval_max_length", None)

    def on_test_start(self) -> None:
        self.model.eval()
        self._test_rows = []
        self._acc_norm_rows = []
        dataset = self._test_loader().dataset
        self._open_ended = len(dataset) > 0 and isinstance(dataset[0], OpenQARecord)
        if self._open_ended:
            return
        if self.option_tokens is None:  # the base row's choice holds for the method's
            size = self.scorer.probe_size
            probe = self.probe_batch(size) if size else None
            self.option_tokens = self.scorer.select_option_tokens(self.model, self.tokenizer, probe)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        # The test loader hands whole batches to the processes in turn (data module): this
        # is the batch's index in the single-process order, whatever the world size.
        rank, size = world()
        index = batch_idx * size + rank
        if self._open_ended:
            # Each batch draws from its own stream, seeded by its index: the same samples on
            # any number of processes, and for base and method in one run (common random
            # numbers for their comparison).
            generator = torch.Generator(device=self.device)
            generator.manual_seed(self.openqa.seed * 1_000_003 + index)
            rows = score_openqa_batch(self.model, self.tokenizer, batch, self.openqa, generator)
            self._test_rows.append((index, rows))
            return
        before = len(self._acc_norm_rows)
        probs, predicted = self.option_probabilities(batch)
        acc_norm = self._acc_norm_rows[before:]  # the scorer's side choices for this batch
        del self._acc_norm_rows[before:]
        self._test_rows.append(
            (
                index,
                (
                    list(batch["ids"]),
                    probs.double().cpu(),
                    batch["labels"].cpu(),
                    None if predicted is None else predicted.cpu(),
                    [(a.cpu(), y.cpu()) for a, y in acc_norm],
                ),
            )
        )

    def _n_test(self) -> int:
        return len(self._test_loader().dataset)

    def _gathered_rows(self) -> list:
        """Every process's test batches (one process: its own), in single-process order."""
        entries = [e for rows in gather_objects(self._test_rows) for e in rows]
        n_global = getattr(self._test_loader().batch_sampler, "n_global", None)
        if n_global is not None:  # drop the copies idle processes scored (runtime/distributed.py)
            entries = [e for e in entries if e[0] < n_global]
        return [rows for _, rows in sorted(entries, key=lambda e: e[0])]

    def option_probabilities(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(B, K) option probabilities and, for methods that state their answer apart from
        the probabilities, the (B,) answers (None = the argmax). Methods that produce their
        confidence differently (IC, CAPE, elicitation) override this, nothing else."""
        logits, side = self.scorer.option_logits(
            self.model, self.tokenizer, batch, self.option_tokens, self.eval_max_length
        )
        if side is not None:  # e.g. cloze's acc_norm choice, for `extra_metrics`
            self._acc_norm_rows.append((side, batch["labels"].cpu()))
        return torch.softmax(logits.double(), dim=-1), None

    def on_test_epoch_end(self) -> None:
        batches = self._gathered_rows()
        if self._open_ended:
            rows = [r for batch in batches for r in batch]
            if len(rows) > self._n_test():
                rows = unique_by_id(rows, lambda r: r["id"])
            self.predictions = OpenQAPredictions(rows, self.openqa)
        else:
            self.predictions = self._mcqa_predictions(batches)
        metrics = self.predictions.report(self.n_bins)
        self.log_dict({f"test/{k}": float(v) for k, v in metrics.items()}, sync_dist=False)
        self._test_rows = []

    def _mcqa_predictions(self, batches: list) -> MCQAPredictions:
        ids = [i for rows, _, _, _, _ in batches for i in rows]
        probs = torch.cat([p for _, p, _, _, _ in batches]).numpy()
        labels = torch.cat([y for _, _, y, _, _ in batches]).numpy()
        stated = [a for _, _, _, a, _ in batches]
        predicted = None if stated[0] is None else torch.cat(stated).numpy()
        acc_norm = [row for *_, rows in batches for row in rows]
        keep = list(range(len(ids)))
        if len(ids) > self._n_test():  # a padding sampler repeated questions: count each once
            keep = unique_by_id(keep, ids.__getitem__)
            ids = [ids[i] for i in keep]
            probs, labels = probs[keep], labels[keep]
            predicted = None if predicted is None else predicted[keep]
        extra = {}
        if acc_norm:
            chosen = torch.cat([p for p, _ in acc_norm])
            gold = torch.cat([y for _, y in acc_norm])
            if len(keep) < len(chosen):
                chosen, gold = chosen[keep], gold[keep]
            extra.update(self.scorer.extra_metrics(chosen, gold))
        return MCQAPredictions(ids, probs, labels, self.option_tokens, predicted, extra)

    def check_arguments(self, **values) -> None:
        """The class's `config_rules` applied to constructor arguments: the same checks the
        pipeline runs on the config before any model loads (config_checks.py). Each class
        checks the arguments it takes (a rule `a.b` belongs to the argument `a`)."""
        rules = merged_rules(type(self))
        mine = {key: rule for key, rule in rules.items() if key.split(".")[0] in values}
        check_values("method.module", values, mine)

    def save_calibration(self, directory) -> None:
        """Write what calibration changed (adapter + head) to `directory`."""
        self.model.save(directory)

    # ----- the protocol the pipeline calls -----
    @classmethod
    def check_requirements(cls, cfg, sources: dict) -> None:
        """Refuse a method / setting pair that cannot work, before any model is loaded."""
        method, setting = cfg.method.name, cfg.setting.name
        scorer = scorer_from_config(cfg.get("evaluation"))
        if scorer.name not in cls.scorers:
            raise ConfigError(
                f"method={method} does not support evaluation.scoring={scorer.name}: "
                f"{cls.cloze_refusal or 'it scores the option letters'}; use "
                f"evaluation.scoring={cls.scorers[0]}"
            )
        kind = getattr(sources.get("train"), "kind", None)
        if cls.train_kinds is not None and kind not in cls.train_kinds:
            raise ConfigError(
                f"method={method} cannot run in setting={setting}: {cls.train_kinds_reason}"
            )
        if cls.needs_heldout and sources.get("heldout") is None:
            raise ConfigError(
                f"method={method} needs held-out data, which setting={setting} does not "
                "define (setting.heldout)"
            )
        if cls.needs_reference_model and not cfg.get("reference_model"):
            raise ConfigError(
                f"method={method} calibrates against a pre-trained model and needs "
                "reference_model=<PLM of the same family as the model>, e.g. "
                "`model=llama31_8b_instruct reference_model=llama31_8b` or "
                "`model=qwen25_7b_instruct reference_model=qwen25_7b` (conf/reference_model/)"
            )
        if cls.head == HEAD_CONFIGURED and not cfg.method.get("head"):
            raise ConfigError(
                f"method={method} tunes a logit-adjustment head: set method.head "
                "(kind: vector | scalar, center: none | logsumexp | mean)"
            )

    @classmethod
    def build_model(cls, loaded, peft: dict, head: dict | None = None) -> CalibratedLM:
        """The loaded LM with this method's adapters (per the `peft` group) and head.

        `head` is the method's configured head (`method.head`), read only when the method
        tunes one (HEAD_CONFIGURED).
        """
        lm = loaded.model
        peft = dict(peft)
        kind = peft.pop("method", "none")
        if kind not in ("lora", "none"):
            raise ConfigError(f"peft.method={kind!r} is not one of lora, none")
        if cls.uses_adapter and kind == "lora":
            lm = wrap_with_lora(lm, peft, quantized=loaded.quantized)
        options = {HEAD_CONFIGURED: head, HEAD_TEMPERATURE: TEMPERATURE_HEAD}.get(cls.head)
        module = None
        if options:
            vocab = lm.get_output_embeddings().weight.shape[0]
            module = LogitAdjustment(vocab, **options)
        return CalibratedLM(lm, module)

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        """Change the model before evaluation; return what was fitted (for metrics.json).
        The base method changes nothing."""
        return {}


class PosthocTemperature(CalibrationMethod):
    """A method that fits one temperature on held-out data without training: a predict pass
    over `posthoc_loader(datamodule)` collects what the fit needs, `fit_posthoc` fits T and
    installs it as the scalar head d = 1 / T (accuracy unchanged)."""

    head = HEAD_TEMPERATURE
    needs_heldout = True
    changes_model = True

    def calibrate(self, trainer, datamodule, ckpt_path: str | None = None) -> dict:
        loader = self.posthoc_loader(datamodule)
        trainer.predict(self, dataloaders=loader, return_predictions=False)
        return {"posthoc": self.fit_posthoc()}

    def posthoc_loader(self, datamodule):
        """The held-out batches the fit reads."""
        raise NotImplementedError

    def fit_posthoc(self) -> dict:
        """Fit T on what the predict pass collected, install it, return the fit's summary."""
        raise NotImplementedError


class BaseMethod(CalibrationMethod):
    """The aligned model as it is (the paper's DPO / RLHF row): no training."""

    scorers = ("letter", "cloze")


def method_class(cfg) -> type[CalibrationMethod]:
    """The class a run config's `method.module._target_` names (its requirements are class
    attributes); a target that is not one of the project's methods is a ConfigError."""
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    target = OmegaConf.select(cfg, "method.module._target_")
    try:
        cls = get_class(str(target))
    except Exception as err:  # ImportError, AttributeError: no such class
        raise ConfigError(f"method.module._target_={target}: no such class ({err})") from err
    if not (isinstance(cls, type) and issubclass(cls, CalibrationMethod)):
        raise ConfigError(f"method.module._target_={target} is not a CalibrationMethod")
    return cls


def stated_answer_probs(confidence: torch.Tensor, answer: torch.Tensor, k: int) -> torch.Tensor:
    """(B, K) rows with `confidence` on `answer` and the rest spread evenly over the others."""
    confidence = confidence.double().clamp(0.0, 1.0)
    probs = ((1 - confidence) / (k - 1))[:, None].repeat(1, k)
    probs[torch.arange(len(answer)), answer] = confidence
    return probs
