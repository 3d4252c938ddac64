"""What one job of a sweep will do, read from the config `calm_lightning.run` composes for it:
its data and batches, its epochs (`batches_per_epoch`: the budget's epoch of the bilevel
methods), its method's passes, its model's shape and its base-cache entry (`base_cache_key`).
plan.py lists a sweep's jobs; passes.py prices each. Nothing here imports torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources

from omegaconf import OmegaConf

from calm_lightning.errors import ConfigError
from calm_lightning.evaluation.base_cache import NOT_MODEL, NOT_SCORING
from calm_lightning.method_traits import MethodTraits, method_traits
from calm_lightning.models.lora import checkpointing_enabled
from calm_lightning.models.model_node import planned_quantization, revision_note
from calm_lightning.models.shapes import Shape, parameter_count
from calm_lightning.planning import cost_model

CONF_PACKAGE = "calm_lightning.conf"  # the config tree (top-level conf/ in a checkout)


@dataclass
class Job:
    """One job of a sweep: its overrides and what its composed config says it will do."""

    overrides: list[str]
    method: str
    model: str
    # What the method declares (its conf/method/*.yaml traits): passes.py prices by these.
    traits: MethodTraits = field(default_factory=lambda: MethodTraits("single"))
    train_rows: int | None = None
    heldout_rows: int | None = None
    eval_rows: int | None = None
    batch: int = 1
    eval_batch: int = 1
    max_length: int = 1
    train_steps: int = 0
    epochs: int = 0
    epoch_batches: int = 0  # training batches per epoch, as the data module yields them
    budget: str | None = None  # conf/budget option the job composed with (None: no such group)
    bilevel_epoch_batches: int | None = None  # the budget's epoch of the bilevel methods
    base_key: str | None = None  # its base-cache entry (None: the base model is not cached)
    base_read_from: int | None = None  # the earlier job whose cached base row it reads
    schedule: str | None = None
    inner_steps: int | None = None
    surrogate_steps: int | None = None
    lower_steps: int = 1
    compare_with_base: bool = False
    heldout_batch: int = 1
    eval_max_length: int = 1
    shape: Shape | None = None  # the architecture the model runs (cost_model.model_shape)
    quantized: bool = True  # nf4 QLoRA (quantization auto on a GPU) or bf16
    quantization_reason: str = ""  # why the plan assumes `quantized` (model_node.py's rule)
    lora_r: int = 0
    checkpointing: bool = False
    sampling: tuple[int, int] | None = None  # open QA: (samples, max new tokens) per question
    train_source: str | None = None  # the training data's source class (passes.py widths)
    reference_shape: Shape | None = None  # post-hoc methods' pre-trained reference model
    reference_quantized: bool = False
    mcqa_training: bool = False  # the training split is MCQA (a letter answer per example)
    entropy_heldout: bool = False  # a single-level loss's entropy on a held-out batch (reg)
    heldout_scored: bool = False  # the held-out split scored after calibration (heldout_pass)
    mcqa_heldout: bool = False  # that split is MCQA (else instructions at max_length)
    eval_kept_positions: int = 1  # logit positions an evaluation row keeps (cloze: all)
    unpinned: list[str] = field(default_factory=list)  # a warning per unpinned Hub revision
    call: int = 0  # which `calm_lightning.run` call of its sweep launches it (sweep.plan)
    launcher_limit_min: int | None = None  # its call's hydra.launcher.timeout_min, if set
    estimate: dict = field(default_factory=dict)


def compose_run(overrides: list[str], hydra: bool = False):
    """The config `calm_lightning.run` composes from `overrides`; Hydra's refusals (an unknown
    group option, a malformed override) as one-line ConfigErrors."""
    from hydra import compose, initialize_config_module
    from hydra.errors import HydraException, MissingConfigException

    import calm_lightning.runtime.resolvers  # noqa: F401  (registers the config resolvers)

    try:
        with initialize_config_module(CONF_PACKAGE, version_base="1.3"):
            return compose("run", overrides=overrides, return_hydra_config=hydra)
    except MissingConfigException as err:
        if err.missing_cfg_file and err.options:
            group, _, name = str(err.missing_cfg_file).rpartition("/")
            raise ConfigError(
                f"{group}={name}: conf/{group}/ has no option {name!r}; choose one of "
                f"{', '.join(sorted(err.options))}"
            ) from err
        raise ConfigError(str(err).splitlines()[0]) from err
    except HydraException as err:
        raise ConfigError(" ".join(str(err).split())) from err


def group_options(group: str) -> list[str]:
    """The options of a config group (conf/<group>/*.yaml), sorted."""
    folder = resources.files(CONF_PACKAGE).joinpath(group)
    return sorted(
        p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml")
    )


# Rows of hub datasets whose training split is "all the rest" (train_size: null), from their
# dataset cards: PopQA is 14,267 questions in one split.
HUB_ROWS = {"akariasai/PopQA": 14_267}


def split_rows(node) -> int | None:
    """How many rows a data node's split has, from its config (None: only the files know)."""
    if "fit_fraction" in node and "source" in node:  # a fit / test carving of a pool
        pool = split_rows(node.source)
        fit = round(float(node.fit_fraction) * pool) if pool else None
        return None if pool is None else (fit if node.get("part") == "fit" else pool - fit)
    split = node.get("split")
    size = None
    if f"{split}_size" in node:  # alpaca-style: train_size / heldout_size / test_size
        size = node.get(f"{split}_size")
        if size is None and split == "train" and node.get("hub_id") in HUB_ROWS:
            taken = [node.get(k) or 0 for k in ("eval_size", "heldout_size", "test_size")]
            size = HUB_ROWS[node.hub_id] - sum(taken)
    elif "sizes" in node and split in node.sizes:  # mcqa-style blocks
        size = node.sizes[split]
    limit = node.get("limit")
    if size is None:
        return limit
    return min(int(size), int(limit)) if limit else int(size)


def describe(overrides: list[str], sweep: str | None = None) -> Job:
    """Compose one job's config as `calm_lightning.run` would and read what it will do;
    `sweep` names the sweep folder it runs in (None: a run in its own folder)."""
    cfg = compose_run(overrides)
    select = OmegaConf.select
    setting, trainer, module = cfg.setting, cfg.trainer, cfg.method.get("module") or {}
    job = Job(
        overrides=overrides,
        method=str(cfg.method.name),
        traits=method_traits(cfg.method),
        model=_model_label(select(cfg, "model.name"), select(cfg, "model.shape", default=None)),
        train_rows=split_rows(setting.train) if "train" in setting else None,
        heldout_rows=split_rows(setting.heldout) if "heldout" in setting else None,
        eval_rows=split_rows(setting.test) if "test" in setting else None,
        batch=int(setting.get("batch_size", 1)),
        eval_batch=int(setting.get("eval_batch_size", setting.get("batch_size", 1))),
        max_length=int(setting.get("max_length", 1)),
        compare_with_base=bool(select(cfg, "evaluation.compare_with_base", default=False)),
        budget=select(cfg, "budget.name", default=None),
        bilevel_epoch_batches=select(cfg, "budget.bilevel_epoch_batches", default=None),
    )
    _describe_costs(job, cfg)
    epochs = trainer.get("max_epochs")
    if epochs and job.traits.trains:
        job.epochs = int(epochs)
        job.epoch_batches = batches_per_epoch(
            job.train_rows, job.batch, select(cfg, "method.epoch_batches", default=None),
            trainer.get("limit_train_batches"),
        )  # fmt: skip
        job.train_steps = job.epochs * job.epoch_batches
        if int(trainer.get("max_steps", -1)) > 0:
            job.train_steps = min(job.train_steps, int(trainer.max_steps))
    if job.traits.bilevel:
        job.schedule = str(select(cfg, "method.module.surrogate.schedule", default="per_step"))
        job.inner_steps = int(module.get("inner_steps", 1))
        job.surrogate_steps = int(select(cfg, "method.module.surrogate.steps", default=1))
    if job.traits.training == "alternating":
        job.lower_steps = int(module.get("lower_steps", 1))
    job.base_key = base_cache_key(cfg, sweep)
    return job


def batches_per_epoch(rows: int | None, batch: int, epoch_batches, limit) -> int:
    """Training batches one epoch yields: the data module's sampler drops the last partial
    batch (rows // batch) and, given `method.epoch_batches` (the budget's epoch of a bilevel
    method), yields that many; Lightning's `trainer.limit_train_batches` then cuts the loader
    to a count, or to a fraction of its length. 0 when none of them is known."""
    sizes = [rows // batch] if rows else []
    if epoch_batches is not None:
        sizes.append(int(epoch_batches))
    if isinstance(limit, int) and not isinstance(limit, bool):
        sizes.append(limit)
    per_epoch = min(sizes) if sizes else 0
    if isinstance(limit, float):
        per_epoch = int(per_epoch * limit)
    return per_epoch


def base_cache_key(cfg, sweep: str | None) -> str | None:
    """What the job's cached base row depends on (evaluation/base_cache.py's fingerprint, as far
    as the config tells it), None when the job does not share one: the base model is not
    scored (`compare_with_base` off), or is scored by every job (`base_cache` off, or a run in
    its own folder). The fingerprint also holds the test records' content and the code: the
    same for every job of one sweep. A job of the same key in the same cache folder reads the
    first one's row instead of scoring the base model again."""
    evaluation = cfg.get("evaluation") or {}
    if not (evaluation.get("compare_with_base") and evaluation.get("base_cache")):
        return None
    folder = evaluation.get("base_cache_dir") or sweep
    if folder is None:
        return None
    plain = OmegaConf.to_container
    scoring = {k: v for k, v in plain(evaluation, resolve=True).items() if k not in NOT_SCORING}
    test = plain(cfg.setting.test, resolve=True) if "test" in cfg.setting else {}
    if not str(test.get("_target_", "")).endswith("OpenQASource"):
        scoring.pop("openqa", None)  # multiple-choice scoring never samples
    trainer = plain(cfg.trainer, resolve=False)  # precision `auto` left unresolved (no torch)
    key = {
        "folder": str(folder),
        "model": {k: v for k, v in plain(cfg.model, resolve=True).items() if k not in NOT_MODEL},
        "test": test,
        "scoring": scoring,
        "batches": [cfg.setting.get("eval_batch_size"), cfg.setting.get("eval_max_length")],
        "wrapping": [
            OmegaConf.select(cfg, "method.module._target_", default=None),
            plain(cfg.method.head, resolve=True) if "head" in cfg.method else None,
            plain(cfg.peft, resolve=True) if "peft" in cfg else None,
        ],
        "numerics": [trainer.get(k) for k in ("accelerator", "precision", "devices", "num_nodes")],
        "setting": cfg.setting.get("name"),
    }
    return json.dumps(key, sort_keys=True, default=str)


def _describe_costs(job: Job, cfg) -> None:
    """What the cost model needs from a composed config."""
    select, setting = OmegaConf.select, cfg.setting
    model = OmegaConf.to_container(cfg.model, resolve=True)
    job.shape = cost_model.model_shape(model)
    planned = planned_quantization(model)
    job.quantized, job.quantization_reason = planned.four_bit, planned.reason
    job.lora_r = int(select(cfg, "peft.r", default=0) or 0)
    job.checkpointing = checkpointing_enabled(
        select(cfg, "peft.gradient_checkpointing", default=False),
        parameter_count(job.shape) if job.shape is not None else 0,
    )
    train_target = str(select(cfg, "setting.train._target_", default="") or "")
    job.train_source = train_target.rsplit(".", 1)[-1] or None
    job.mcqa_training = "train" in setting and _is_mcqa(setting.train)
    job.mcqa_heldout = "heldout" in setting and _is_mcqa(setting.heldout)
    job.heldout_scored = "heldout" in setting and bool(
        select(cfg, "evaluation.heldout_metrics", default=False)
    )
    job.entropy_heldout = str(select(cfg, "method.module.entropy_on", default="")) == "heldout"
    scoring = str(select(cfg, "evaluation.scoring", default="letter"))
    job.heldout_batch = int(setting.get("heldout_batch_size") or job.batch)
    job.eval_max_length = int(setting.get("eval_max_length", job.max_length))
    test_target = str(select(cfg, "setting.test._target_", default="") or "")
    if test_target.endswith("OpenQASource"):
        openqa = cfg.evaluation.openqa
        job.sampling = (int(openqa.n_samples), int(openqa.max_new_tokens))
    # Only methods whose module takes the reference (daca, dual_align) load the PLM.
    reference = select(cfg, "method.module.reference_model", default=None)
    if reference is not None and str(reference.get("name", "none")) != "none":
        ref = OmegaConf.to_container(reference, resolve=True)
        job.reference_shape = cost_model.model_shape(ref)
        job.reference_quantized = planned_quantization(ref, "reference_model").four_bit
        job.unpinned.append(revision_note(ref, "reference_model"))
    job.unpinned = [note for note in (revision_note(model), *job.unpinned) if note]
    # letter scoring, the logit lens and the sampler keep the last position (cost_model)
    job.eval_kept_positions = job.eval_max_length if scoring == "cloze" else 1


def _is_mcqa(node) -> bool:
    """Whether a data node yields MCQA records (trained as a letter answer): the MCQA
    benchmark, a local or demo source of kind mcqa, or a fit / test carving of one."""
    if "kind" in node:
        return str(node.kind) == "mcqa"
    if "source" in node and hasattr(node.source, "get"):
        return _is_mcqa(node.source)
    return str(node.get("_target_", "") or "").endswith(".MCQASource")


def _model_label(name, shape) -> str:
    return f"{name} (shape {shape})" if shape else str(name)
