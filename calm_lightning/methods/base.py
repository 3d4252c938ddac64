"""The method protocol.

Every method is a `CalibrationMethod` (a LightningModule). The pipeline knows only this
protocol (docs/architecture.md):

* class attributes state what the method needs, checked before any model is loaded
  (`check_requirements`): adapters, a logit-adjustment head, held-out data, a reference model,
  the kind of training data;
* `build_model` wraps the loaded LM into the `CalibratedLM` the method works on;
* `calibrate(trainer, datamodule, ckpt_path)` does whatever the method does before evaluation
  (nothing for `base`, `Trainer.fit` for training methods, a fit on held-out data for post-hoc
  temperatures) and returns what it fitted, for metrics.json;
* evaluation is shared: each method owns a `TestEvaluator` (evaluation/evaluator.py) that
  holds the test pass (MCQA option scoring, or sampling + Sem-ECE when the test split is
  open-ended QA); the Lightning test hooks only hand it the loader and the batches. Methods
  that produce their confidence differently override `option_probabilities` and nothing else.
"""

from __future__ import annotations

from typing import ClassVar

import lightning as L
import torch

from calm_lightning.config_rules import check_values, merged_rules
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.evaluator import MCQAPredictions, ScoredOptions, TestEvaluator
from calm_lightning.evaluation.mcqa import OptionTokens
from calm_lightning.evaluation.openqa import OpenQAPredictions, OpenQASettings
from calm_lightning.evaluation.scorers import MCQAScorer, scorer_from_config
from calm_lightning.models.calibrated_lm import CalibratedLM
from calm_lightning.models.logit_adjustment import LogitAdjustment
from calm_lightning.models.lora import PEFT_RULES, wrap_with_lora

# `head` values: no head, the method's configured head (`method.head`: kind, center), one
# scalar temperature d = 1 / T over the untouched logits (post-hoc temperature methods), or a
# per-token d_v, l_v over the untouched logits (post-hoc per-token methods: vs, oracle).
HEAD_NONE, HEAD_CONFIGURED, HEAD_TEMPERATURE = None, "configured", "temperature"
HEAD_VECTOR = "vector"
TEMPERATURE_HEAD = {"kind": "scalar", "center": "none"}
VECTOR_HEAD = {"kind": "vector", "center": "none"}


class CalibrationMethod(L.LightningModule):
    """Holds the calibrated LM, calibrates it (`calibrate`) and scores test batches (its
    `evaluator` runs the test pass)."""

    # ----- what the method needs (checked before any model is loaded) -----
    uses_adapter: ClassVar[bool] = False  # attach the `peft` group's adapters
    # HEAD_NONE | HEAD_CONFIGURED | HEAD_TEMPERATURE | HEAD_VECTOR
    head: ClassVar[str | None] = HEAD_NONE
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
        # The run's option tokens, chosen once (by the first test pass, a temperature fit or a
        # cached base row) and kept for every later scoring.
        self.option_tokens: OptionTokens | None = None
        self.evaluator = TestEvaluator(scoring, n_bins, openqa)

    # ----- evaluation (the evaluator's; Lightning drives it through these hooks) -----
    @property
    def predictions(self) -> MCQAPredictions | OpenQAPredictions | None:
        """The last test pass's predictions."""
        return self.evaluator.predictions

    @property
    def eval_max_length(self) -> int | None:
        """The setting's longest MCQA prompt (the fitted data module's), None without one."""
        return getattr(getattr(self._trainer, "datamodule", None), "eval_max_length", None)

    def _test_loader(self):
        loader = self.trainer.test_dataloaders
        return loader[0] if isinstance(loader, list | tuple) else loader

    def on_test_start(self) -> None:
        self.model.eval()
        self.option_tokens = self.evaluator.start(
            self._test_loader(), self.model, self.tokenizer, self.device, self.option_tokens
        )

    def test_step(self, batch: dict, batch_idx: int) -> None:
        if self.evaluator.open_ended:
            self.evaluator.sample(self.model, self.tokenizer, batch, batch_idx, self.device)
        else:
            self.evaluator.add(batch, batch_idx, self.option_probabilities(batch))

    def option_probabilities(self, batch: dict) -> ScoredOptions:
        """(B, K) option probabilities and, for methods that state their answer apart from
        the probabilities, the (B,) answers (None = the argmax); the scorer's side choices
        (cloze's acc_norm) ride along. Methods that produce their confidence differently
        (IC, CAPE, elicitation) override this, nothing else."""
        logits, side = self.scorer.option_logits(
            self.model, self.tokenizer, batch, self.option_tokens, self.eval_max_length
        )
        return ScoredOptions(torch.softmax(logits.double(), dim=-1), side=side)

    def on_test_epoch_end(self) -> None:
        metrics = self.evaluator.finish()
        split = self.evaluator.split
        self.log_dict({f"{split}/{k}": float(v) for k, v in metrics.items()}, sync_dist=False)

    def check_arguments(self, **values) -> None:
        """The class's `config_rules` applied to constructor arguments: the same checks the
        pipeline runs on the config before any model loads (validation.py). Each class
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
        check_values("peft", {"method": kind}, PEFT_RULES)
        if cls.uses_adapter and kind == "lora":
            lm = wrap_with_lora(lm, peft, quantized=loaded.quantized)
        options = {
            HEAD_CONFIGURED: head,
            HEAD_TEMPERATURE: TEMPERATURE_HEAD,
            HEAD_VECTOR: VECTOR_HEAD,
        }.get(cls.head)
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
