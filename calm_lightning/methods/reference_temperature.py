"""Post-hoc temperatures fitted against a pre-trained reference model (the Dual-Align paper's
protocol): `DACA` and `DualAlign` fit one temperature for the post-trained model (PoLM) on the
setting's fit split (labels unused) from the logit lens of both models (one forward each, cached
per dataset); T is installed as the scalar head d = 1/T. The losses and the Adam fit are pure
functions in `calm_lightning.calibrators.reference`; docs/posthoc.md has every choice.

The PoLM always reads its own chat-templated prompt (the one it is evaluated on, so T is fitted
on the logits it will divide). The PLM reads `reference_prompt`: `chat` (default) the PoLM's
rendered prompt text re-tokenized by the PLM, the same input as the paper defines it; `plain`
the question, options and instruction followed by "Answer:" with no chat template, in its own
tokenization with its own special tokens, as DACA's public code feeds the models.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
from dataclasses import fields, replace
from pathlib import Path
from typing import ClassVar

import torch
from torch.utils.data import DataLoader

from calm_lightning.calibrators.reference import (
    WEIGHTS,
    agreement_mask,
    daca_loss,
    dual_align_loss,
    dual_align_targets,
    fit_temperature_adam,
    inferential_stability_entropy,
)
from calm_lightning.config_rules import Number, OneOf
from calm_lightning.data.collate import pad_left
from calm_lightning.data.prompts import mcqa_plain_prompt, mcqa_user_text, render_prompt
from calm_lightning.data.tokens import cut_left, encode_prompt
from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.mcqa import OptionTokens, option_token_candidates
from calm_lightning.methods.base import PosthocTemperature
from calm_lightning.models.logit_lens import lens_option_logits
from calm_lightning.runtime.distributed import is_main_process

log = logging.getLogger(__name__)

# 2: the PLM's prompt (`reference_prompt`) is part of the key; 3: prompts get BOS where the
# tokenizer adds one by default, letters are read from the joint encoding (data/tokens.py)
LENS_CACHE_VERSION = 3
REFERENCE_PROMPTS = ("plain", "chat")
NOT_COMPARABLE = (
    "%s: the %s (%s) is loaded in 4-bit nf4. The Dual-Align paper compares unquantized models, "
    "so these numbers are not comparable with its tables (%s.quantization=none loads it at "
    "its dtype)."
)


class ReferenceTemperature(PosthocTemperature):
    """Shared part of DACA and Dual-Align: the lens pass over the fit split, the cache, and
    installing T; subclasses define the loss."""

    needs_reference_model = True
    config_rules: ClassVar[dict] = {
        "lr": Number(minimum=0, exclusive_minimum=True),
        "epochs": Number(minimum=1, integer=True),
        "batch_size": Number(minimum=1, integer=True),
        "init_temperature": Number(minimum=0, exclusive_minimum=True),
        "reference_prompt": OneOf(REFERENCE_PROMPTS),
    }
    cloze_refusal = (
        "DACA and Dual-Align fit T on both models' logit lens over the option letters at the "
        "answer slot; Dual-Align's layer-wise alignment has no cloze counterpart (no single "
        "position per option) and a cloze DACA (both models' option likelihoods, T at every "
        "token) is not implemented. Fit them with letter scoring, or use method=ts for a "
        "temperature fitted on the cloze distribution"
    )

    def __init__(
        self,
        model,
        tokenizer=None,
        reference_model: dict | None = None,
        model_config: dict | None = None,
        cache_dir: str | None = None,
        use_cache: bool = True,
        lr: float = 0.05,
        epochs: int = 300,
        batch_size: int = 128,
        init_temperature: float = 1.0,
        parameterisation: str = "log",
        with_embeddings: bool = False,
        reference_prompt: str = "chat",
        seed: int = 0,
        **evaluation,
    ) -> None:
        super().__init__(model, tokenizer, **evaluation)
        self.check_arguments(
            lr=lr,
            epochs=epochs,
            batch_size=batch_size,
            init_temperature=init_temperature,
            reference_prompt=reference_prompt,
        )
        if not reference_model:
            raise ConfigError(f"{type(self).__name__} needs reference_model=<PLM>")
        if model.head is None or model.head.kind != "scalar":
            raise ConfigError(f"{type(self).__name__} needs a scalar head (build_model makes one)")
        self.reference_cfg = dict(reference_model)
        self.model_cfg = dict(model_config or {})
        polm_name = self.model_cfg.get("name")
        if polm_name and self.reference_cfg.get("pairs_with") not in (None, polm_name):
            log.warning(
                "reference_model=%s pairs with model=%s, but the model is %s",
                self.reference_cfg.get("name"),
                self.reference_cfg.get("pairs_with"),
                polm_name,
            )
        self.cache_dir = cache_dir
        self.use_cache = bool(use_cache)
        self.fit_options = {
            "lr": float(lr),
            "epochs": int(epochs),
            "batch_size": int(batch_size),
            "init": float(init_temperature),
            "parameterisation": parameterisation,
            "seed": int(seed),
        }
        self.with_embeddings = bool(with_embeddings)
        self.reference_prompt = reference_prompt
        self._reference = None
        self._lens: dict | None = None
        self.fit_info: dict = {}

    # ----- the fit split and its cache -----
    def _cache_path(self, prompts: list[str], ids: list[str], max_length: int) -> Path:
        from calm_lightning.models.embedded import cache_root

        def identity(node: dict) -> dict:
            return {k: v for k, v in node.items() if k not in ("cache_dir", "name", "pairs_with")}

        digest = hashlib.sha256()
        header = {
            "version": LENS_CACHE_VERSION,
            "polm": identity(self.model_cfg),
            "plm": identity(self.reference_cfg),
            "option_tokens": self.scorer.option_token_style,
            "probe_size": self.scorer.probe_size,
            "with_embeddings": self.with_embeddings,
            "reference_prompt": self.reference_prompt,
            "max_length": max_length,
        }
        digest.update(json.dumps(header, sort_keys=True, default=str).encode())
        for example_id, prompt in zip(ids, prompts, strict=True):
            digest.update(f"{example_id}\0{prompt}\0".encode())
        return cache_root(self.cache_dir) / "reference_lens" / f"{digest.hexdigest()[:24]}.pt"

    def posthoc_loader(self, datamodule) -> DataLoader:
        if datamodule.sources.get("heldout") is None:
            raise ConfigError(f"{type(self).__name__} needs a fit split (setting.heldout)")
        records = datamodule._load("heldout")
        if not records or not hasattr(records[0], "choices"):
            raise ConfigError(f"{type(self).__name__} fits on multiple-choice held-out data")
        self._records = {r.id: r for r in records}
        self._max_length = datamodule.eval_max_length
        prompts = [render_prompt(self.tokenizer, mcqa_user_text(r)) for r in records]
        self._cache_file = self._cache_path(prompts, [r.id for r in records], self._max_length)
        self._lens, self._cache_status = None, "off"
        if self.use_cache and self._cache_file.is_file():
            cached = torch.load(self._cache_file, weights_only=True)
            tokens = OptionTokens(cached["style"], tuple(cached["option_ids"]), cached["letters"])
            # The option spelling may already be fixed by the base evaluation; a cache made
            # with another spelling is not reused.
            if self.option_tokens in (None, tokens):
                self.option_tokens, self._lens = tokens, cached
                self._cache_status = "hit"
                log.info("logit-lens cache hit: %s", self._cache_file)
                return DataLoader([])
        loader = DataLoader(
            records, batch_size=datamodule.eval_batch_size, collate_fn=datamodule.test_collator
        )
        self._cache_status = "miss" if self.use_cache else "off"
        return loader

    def on_predict_start(self) -> None:
        self.model.eval()
        self._rows: dict[str, list] = {"ids": [], "polm": [], "plm": []}

    @classmethod
    def build_model(cls, loaded, peft: dict, head: dict | None = None):
        if loaded.quantized:
            log.warning(NOT_COMPARABLE, cls.__name__, "PoLM", loaded.name, "model")
        return super().build_model(loaded, peft, head)

    def _load_reference(self, n_options: int):
        from calm_lightning.models.loading import load_language_model

        loaded = load_language_model(self.reference_cfg)
        if loaded.quantized:
            log.warning(NOT_COMPARABLE, type(self).__name__, "PLM", loaded.name, "reference_model")
        # The PLM's letters where it reads them: after the prompt it is given.
        context = self._reference_text(next(iter(self._records.values())))
        candidates = option_token_candidates(loaded.tokenizer, n_options, prompt=context)
        theirs = candidates.get(self.option_tokens.style)
        if theirs is None or theirs.ids != self.option_tokens.ids:
            raise ConfigError(
                f"the PoLM and reference_model={self.reference_cfg.get('name')} disagree on the "
                f"option tokens: PoLM {self.option_tokens.style!r} letters "
                f"{self.option_tokens.letters} are ids {list(self.option_tokens.ids)}, the PLM's "
                f"are {list(theirs.ids) if theirs else 'not single tokens'}. Pair models of one "
                "family (same tokenizer)."
            )
        if not loaded.quantized:  # 4-bit weights are placed on the GPU when loaded
            loaded.model.to(self.device)
        loaded.model.eval()
        return loaded

    def _reference_text(self, record) -> str:
        """The text the PLM reads for one fit question (`reference_prompt`)."""
        if self.reference_prompt == "chat":
            return render_prompt(self.tokenizer, mcqa_user_text(record))
        return mcqa_plain_prompt(record)

    def _reference_ids(self, record) -> list[int]:
        """The PLM's token ids for one fit question (`reference_prompt`), cut from the left to
        the evaluation length."""
        tok = self._reference.tokenizer
        text = self._reference_text(record)
        if self.reference_prompt == "chat":
            # The PoLM's rendered template, re-tokenized by the PLM as MCQACollator encodes a
            # prompt (data/tokens.py: the PLM's BOS where it takes one, kept when cut).
            return cut_left(tok, encode_prompt(tok, text), self._max_length)
        # No template: the PLM's tokenizer adds its own special tokens (BOS where it uses one),
        # which are kept when a long prompt is cut.
        ids = tok(text)["input_ids"]
        if len(ids) > self._max_length:
            added = len(ids) - len(tok(text, add_special_tokens=False)["input_ids"])
            ids = ids[:added] + ids[added - self._max_length :]
        return ids

    @torch.no_grad()
    def predict_step(self, batch: dict, batch_idx: int) -> None:
        if self.option_tokens is None:
            self.option_tokens = self.scorer.select_option_tokens(self.model, self.tokenizer, batch)
        if self._reference is None:
            self._reference = self._load_reference(batch["n_options"])
        options = self.option_tokens.tensor(self.device)
        polm = lens_option_logits(
            self.model.lm,
            batch["input_ids"],
            batch["attention_mask"],
            options,
            self.with_embeddings,
        )
        rows = [self._reference_ids(self._records[example_id]) for example_id in batch["ids"]]
        ids, mask = pad_left(rows, self._reference.tokenizer.pad_token_id)
        plm = lens_option_logits(
            self._reference.model,
            ids.to(self.device),
            mask.to(self.device),
            options,
            self.with_embeddings,
        )
        self._rows["ids"].extend(batch["ids"])
        self._rows["polm"].append(polm.cpu())
        self._rows["plm"].append(plm.cpu())

    def on_predict_end(self) -> None:
        if self._lens is not None:
            return
        if self._reference is not None:
            self._reference = None  # free the PLM before anything else runs
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        self._lens = {
            "ids": list(self._rows["ids"]),
            "polm": torch.cat(self._rows["polm"]),
            "plm": torch.cat(self._rows["plm"]),
            "style": self.option_tokens.style,
            "option_ids": list(self.option_tokens.ids),
            "letters": self.option_tokens.letters,
        }
        self._rows = {}
        # Under DDP every process computed the same lens logits; one writes the cache (a
        # temporary name of its own, then an atomic rename).
        if self.use_cache and is_main_process():
            self._cache_file.parent.mkdir(parents=True, exist_ok=True)
            partial = self._cache_file.with_suffix(f".{os.getpid()}.tmp")
            torch.save(self._lens, partial)
            partial.replace(self._cache_file)

    def fit_posthoc(self) -> dict:
        """Fit T on the cached lens logits and install d = 1 / T."""
        polm = self._lens["polm"].double()
        plm = self._lens["plm"].double()
        if polm.shape != plm.shape:
            raise ConfigError(
                f"PoLM and PLM lens shapes differ: {tuple(polm.shape)} vs {tuple(plm.shape)} "
                "(the two models must have the same number of layers)"
            )
        loss_fn, info = self.objective(polm, plm)
        fit = fit_temperature_adam(loss_fn, polm.shape[0], **self.fit_options)
        with torch.no_grad():
            self.model.head.scale.fill_(1.0 / fit.temperature)
            self.model.head.bias.zero_()
        self.fit_info = {
            "temperature": fit.temperature,
            "n": int(polm.shape[0]),
            "n_layers": int(polm.shape[1]),
            "loss_before": fit.loss_before,
            "loss_after": fit.loss_after,
            "steps": fit.steps,
            "lens_cache": self._cache_status,
            "reference_prompt": self.reference_prompt,
            **info,
            **{f"fit_{k}": v for k, v in self.fit_options.items()},
        }
        log.info("%s: %s", type(self).__name__, self.fit_info)
        return self.fit_info

    def objective(self, polm: torch.Tensor, plm: torch.Tensor):
        """(loss_fn(index, T), extra info) for `fit_temperature_adam`."""
        raise NotImplementedError


class DACA(ReferenceTemperature):
    """Cross-entropy to the PLM's final distribution on agreement samples only."""

    def objective(self, polm, plm):
        polm_final, plm_probs = polm[:, -1], plm[:, -1].softmax(-1)
        mask = agreement_mask(plm[:, -1], polm_final)

        def loss_fn(index, temperature):
            return daca_loss(polm_final[index], plm_probs[index], mask[index], temperature)

        return loss_fn, {"agreement_rate": float(mask.double().mean())}


class DualAlign(ReferenceTemperature):
    """Divergence-weighted confidence + process (ISE) alignment to the PLM (reconstruction)."""

    config_rules: ClassVar[dict] = {
        "min_layer": Number(minimum=0, integer=True),
        "weight": OneOf(WEIGHTS),
    }

    def __init__(
        self,
        model,
        tokenizer=None,
        min_layer: int = 2,
        weight: str = "peak_jump",
        ise_tempered: str = "all",
        confidence_term: bool = True,
        process_term: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self.check_arguments(min_layer=min_layer, weight=weight)
        if not (confidence_term or process_term):
            raise ConfigError(
                "method.module.confidence_term and method.module.process_term are both false: "
                "dual_align needs one of them (or both)"
            )
        self.min_layer = int(min_layer)
        self.weight = weight
        self.ise_tempered = ise_tempered
        self.components = (bool(confidence_term), bool(process_term))

    def objective(self, polm, plm):
        targets = dual_align_targets(plm, polm, self.min_layer, self.weight)

        def loss_fn(index, temperature):
            part = replace(
                targets, **{f.name: getattr(targets, f.name)[index] for f in fields(targets)}
            )
            return dual_align_loss(
                polm[index], part, temperature, self.ise_tempered, self.components
            )

        peaks = torch.bincount(targets.peak_layer, minlength=polm.shape[1]).tolist()
        ise_f = inferential_stability_entropy(polm.softmax(-1), targets.peak_layer)
        info = {
            "agreement_rate": float(agreement_mask(plm[:, -1], polm[:, -1]).double().mean()),
            "mean_weight": float(targets.weight.mean()),
            "peak_layer_counts": peaks,
            "mean_ise_plm": float(targets.plm_ise.mean()),
            "mean_ise_polm_at_t1": float(ise_f.mean()),
            "min_layer": self.min_layer,
            "weight": self.weight,
            "ise_tempered": self.ise_tempered,
            "components": list(self.components),
        }
        return loss_fn, info
