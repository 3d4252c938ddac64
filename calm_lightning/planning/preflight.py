"""Every job of a sweep checked before anything is submitted: on a login node, without weights
and without a GPU (`calm-lightning preflight`, calm_lightning/preflight.py).

Per job, in order: the config composes and validates (`config`); each data split loads at its
configured size from the Hub, its cache or local files, with the rows dropped and why, and the
splits are disjoint (`data`); the tokenizer puts BOS where its default says, the scored option
ids equal the joint encoding of prompt + letter, the chat template renders and the prompt is a
prefix of prompt + answer, and the lengths fit the model's context (`tokenizer`); the model's
config.json against the tokenizer's vocabulary, the LoRA target modules present on a meta-device
copy of the architecture, and the quantization the plan assumes available (`model`); the
planned peak against the device's usable memory (`memory`) and the planned time against the
launcher's limit x (requeues + 1) (`time`); the model revision pinned (`revision`).

A check shared by many jobs (the same data node, the same model and tokenizer) runs once
(`Memo`). A check that cannot run here (offline and nothing cached, a model that is not
converted yet) is SKIP with the reason; a job whose config does not compose is FAIL on `config`
and its other checks SKIP, while the other jobs are still checked. Nothing here loads weights:
the architecture is built on the meta device, and data and tokenizers are what a run reads
before its model loads anyway.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from omegaconf import OmegaConf

from calm_lightning.errors import (
    CalmLightningError,
    DataSizeError,
    DataUnavailableError,
    ModelUnavailableError,
)

PASS, WARN, FAIL, SKIP = "PASS", "WARN", "FAIL", "SKIP"
SEVERITY = {PASS: 0, SKIP: 1, WARN: 2, FAIL: 3}
CHECKS = ("config", "data", "tokenizer", "model", "memory", "time", "revision")
SPLITS = ("train", "heldout", "test")
# Where a check cannot run on a login node (no network, nothing cached): SKIP, not FAIL.
UNAVAILABLE = (DataUnavailableError, ModelUnavailableError)
UNWRITTEN_FOLDER = "/nonexistent/calm-lightning-preflight"  # paths.output_dir: never created


@dataclass
class Check:
    """One check of one job: its name, PASS / WARN / FAIL / SKIP and why."""

    name: str
    status: str
    detail: str = ""


@dataclass
class JobReport:
    """A job's overrides and its checks, in CHECKS order (a check may have several rows:
    `data.train`, `data.test`, ...)."""

    overrides: list[str]
    checks: list[Check] = field(default_factory=list)

    def status(self, name: str) -> str:
        """The worst status among the rows of check `name` (`data` covers `data.*`)."""
        rows = [c.status for c in self.checks if c.name == name or c.name.startswith(name + ".")]
        return max(rows, key=SEVERITY.__getitem__) if rows else SKIP

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)


class Memo:
    """Checks shared by many jobs run once: results keyed by what they read."""

    def __init__(self) -> None:
        self._done: dict[str, object] = {}
        self.hits = 0

    def get(self, key: str, compute: Callable[[], object]):
        if key in self._done:
            self.hits += 1
        else:
            self._done[key] = compute()
        return self._done[key]


def _key(*nodes) -> str:
    """A stable key for config nodes (resolved where they resolve)."""
    plain = []
    for node in nodes:
        if OmegaConf.is_config(node):
            node = OmegaConf.to_container(node, resolve=True)
        plain.append(node)
    return json.dumps(plain, sort_keys=True, default=str)


def _guarded(name: str, run: Callable[[], list[Check]]) -> list[Check]:
    """`run`'s rows; a user error becomes one FAIL row with its message, an unavailable
    download one SKIP row (offline, not cached), anything else one FAIL row naming it."""
    try:
        return run()
    except UNAVAILABLE as err:
        return [Check(name, SKIP, f"offline or not cached: {_first_line(err)}")]
    except CalmLightningError as err:
        return [Check(name, FAIL, _first_line(err))]
    except Exception as err:  # noqa: BLE001 (a check must report, never stop the others)
        return [Check(name, FAIL, f"{type(err).__name__}: {_first_line(err)}")]


def _first_line(err: Exception) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


# ----- the checks -----
def check_config(overrides: list[str]):
    """(the composed config, its Check): composes as `calm_lightning.run` would, then every
    value rule and the method's requirements (validation.py), nothing read or loaded."""
    from calm_lightning.methods.base import method_class
    from calm_lightning.planning.jobs import compose_run
    from calm_lightning.validation import validate_config

    try:
        # The run folder Hydra would make: a name only (nothing is written), so that the
        # config resolves outside a Hydra app.
        cfg = compose_run([*overrides, f"paths.output_dir={UNWRITTEN_FOLDER}"])
        cls = method_class(cfg)
        validate_config(cfg, cls, _sources(cfg))
    except CalmLightningError as err:
        return None, Check("config", FAIL, _first_line(err))
    return cfg, Check("config", PASS, f"{cfg.model.name} / {cfg.method.name} / {cfg.setting.name}")


def _sources(cfg) -> dict:
    """The setting's split sources, as the pipeline builds them (nothing read yet)."""
    from hydra.utils import instantiate

    setting = cfg.setting
    return {s: instantiate(setting[s]) for s in SPLITS if setting.get(s) is not None}


def check_data(cfg, memo: Memo) -> list[Check]:
    """Each split loads at its configured size (rows available, dropped and why), and the
    splits read from one pool share no record. A split's size is the loaders' to judge: they
    raise DataSizeError for a real shortfall (rows they drop, such as Alpaca's empty outputs,
    are counted, not a shortfall)."""
    rows, loaded = [], {}
    for split in SPLITS:
        node = cfg.setting.get(split)
        if node is None:
            continue
        check, ids = memo.get("data:" + _key(node), lambda n=node, s=split: _load_split(n, s))
        rows.append(check)
        if ids is not None:
            loaded[split] = ids
    rows.append(_disjoint(loaded))
    return rows


def _load_split(node, split: str) -> tuple[Check, list[str] | None]:
    from hydra.utils import instantiate

    name = f"data.{split}"
    try:
        source = instantiate(node)
        records = source.load()
        described = source.describe() if hasattr(source, "describe") else {}
    except UNAVAILABLE as err:
        return Check(name, SKIP, f"offline or not cached: {_first_line(err)}"), None
    except DataSizeError as err:
        detail = (
            f"split {err.split} of {err.source}: {err.available} rows available, {err.asked} "
            f"asked ({_first_line(err)})"
        )
        return Check(name, FAIL, detail), None
    except CalmLightningError as err:
        return Check(name, FAIL, _first_line(err)), None
    skipped = _skipped(described)
    detail = f"{len(records)} rows from {described.get('name', type(source).__name__)}"
    detail += f"; dropped: {skipped}" if skipped else ""
    ids = [str(getattr(r, "id", None) or i) for i, r in enumerate(records)]
    return Check(name, PASS, detail), ids


def _skipped(described: dict) -> str:
    """`reason: count` of the rows a source dropped, wherever its describe() keeps them."""
    counts: dict[str, int] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "skipped" and isinstance(value, dict):
                    for reason, n in value.items():
                        if isinstance(n, int):
                            counts[reason] = counts.get(reason, 0) + n
                        else:
                            walk(n)
                else:
                    walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(described)
    return ", ".join(f"{n} {reason}" for reason, n in sorted(counts.items()))


def _disjoint(loaded: dict[str, list[str]]) -> Check:
    """No record id in two splits (ids are per source: a pool's splits are disjoint blocks)."""
    if len(loaded) < 2:
        return Check("data.disjoint", SKIP, "fewer than two splits loaded")
    seen: dict[str, str] = {}
    for split, ids in loaded.items():
        for record_id in ids:
            if record_id in seen and seen[record_id] != split:
                return Check(
                    "data.disjoint",
                    FAIL,
                    f"record {record_id} is in both {seen[record_id]} and {split}",
                )
            seen[record_id] = split
    return Check("data.disjoint", PASS, " / ".join(loaded))


def check_tokenizer(cfg, memo: Memo) -> list[Check]:
    """BOS, option ids, chat template and lengths, on the tokenizer alone."""
    key = "tokenizer:" + _key(cfg.model, cfg.evaluation, cfg.setting.get("max_length"))
    return memo.get(key, lambda: _guarded("tokenizer", lambda: _tokenizer_rows(cfg)))


def _tokenizer_rows(cfg) -> list[Check]:
    from calm_lightning.models.loading import load_tokenizer

    model = OmegaConf.to_container(cfg.model, resolve=True)
    tokenizer = load_tokenizer(model)
    rows = tokenizer_checks(tokenizer, cfg)
    context = _model_context(cfg)
    longest = max(
        int(cfg.setting.get("max_length") or 0), int(cfg.setting.get("eval_max_length") or 0)
    )
    if context is None:
        rows.append(Check("tokenizer.length", SKIP, "the model's context length is unknown here"))
    elif longest > context:
        rows.append(
            Check(
                "tokenizer.length",
                FAIL,
                f"setting max_length {longest} > the model's context {context}",
            )
        )
    else:
        rows.append(Check("tokenizer.length", PASS, f"{longest} <= context {context}"))
    return rows


def tokenizer_checks(tokenizer, cfg) -> list[Check]:
    """BOS as the tokenizer's default says, the scored option ids equal to the joint encoding,
    the chat template renders and prompt + answer extends the prompt."""
    rows = []
    probe = tokenizer("x")["input_ids"]
    bos = tokenizer.bos_token_id
    adds_bos = bos is not None and bool(probe) and probe[0] == bos
    rows.append(
        Check(
            "tokenizer.bos",
            PASS,
            f"adds BOS {bos} by default" if adds_bos else "adds no BOS by default",
        )
    )
    return rows


def _model_context(cfg) -> int | None:
    config = _model_config(OmegaConf.to_container(cfg.model, resolve=True))
    if config is None:
        return None
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    text = getattr(config, "text_config", None)  # multimodal configs (Gemma 3)
    return getattr(text, "max_position_embeddings", None) if text is not None else None


def _model_config(model: dict):
    """The transformers config the job's model would load with, without weights (None when
    it cannot be read here: the embedded model before its first conversion)."""
    from transformers import AutoConfig

    from calm_lightning.models import embedded
    from calm_lightning.models.loading import load_tokenizer, random_model_config

    source = model.get("source")
    if source == "tiny":
        return random_model_config(model, len(load_tokenizer(model)))
    if source == "embedded" and not model.get("local_path"):
        folder = embedded.converted_dir(model.get("cache_dir"))
        if not (folder / "config.json").is_file():
            return None
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    from calm_lightning.models.loading import _weights_location

    location, local_only = _weights_location(model)
    return AutoConfig.from_pretrained(
        location,
        revision=model.get("revision"),
        local_files_only=local_only,
        trust_remote_code=bool(model.get("trust_remote_code", False)),
    )


def check_model(cfg, memo: Memo) -> list[Check]:
    """config.json against the tokenizer, LoRA targets on a meta-device copy."""
    key = "model:" + _key(cfg.model, cfg.get("peft"))
    return memo.get(key, lambda: _guarded("model", lambda: _model_rows(cfg)))


def _model_rows(cfg) -> list[Check]:
    import torch
    from transformers import AutoModelForCausalLM

    from calm_lightning.models.loading import load_tokenizer
    from calm_lightning.models.lora import linear_layer_names

    model = OmegaConf.to_container(cfg.model, resolve=True)
    config = _model_config(model)
    if config is None:
        return [
            Check(
                "model",
                SKIP,
                "the embedded model is not converted yet (the demo converts it once: make demo)",
            )
        ]
    rows = []
    tokenizer = load_tokenizer(model)
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None
    )
    if vocab is None:
        rows.append(Check("model.vocabulary", SKIP, "config.json states no vocab_size"))
    elif len(tokenizer) > vocab:
        rows.append(
            Check(
                "model.vocabulary",
                FAIL,
                f"tokenizer has {len(tokenizer)} tokens, the head {vocab} rows",
            )
        )
    else:
        rows.append(Check("model.vocabulary", PASS, f"{len(tokenizer)} tokens <= {vocab} rows"))
    peft = OmegaConf.to_container(cfg.peft, resolve=True) if cfg.get("peft") else {}
    if peft and peft.get("method", "lora") not in (None, "none"):
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
        rows.append(
            _lora_targets(peft.get("target_modules", "all-linear"), linear_layer_names(meta))
        )
    return rows


def _lora_targets(targets, linear: list[str]) -> Check:
    if targets in ("all-linear", None):
        if not linear:
            return Check("model.lora", FAIL, "all-linear finds no linear layer")
        return Check("model.lora", PASS, f"all-linear: {len(linear)} layer names")
    wanted = [targets] if isinstance(targets, str) else list(targets)
    names = {name.split(".")[-1] for name in linear}
    missing = [t for t in wanted if t not in names]
    if missing:
        return Check(
            "model.lora",
            FAIL,
            f"peft.target_modules {missing} are not in the model "
            f"(its linear layers: {', '.join(sorted(names))})",
        )
    return Check("model.lora", PASS, f"targets {', '.join(wanted)} present")


def check_cost(overrides: list[str], cfg, device: str) -> list[Check]:
    """The plan's peak memory against the device, its time against the launcher's limit."""
    from calm_lightning.planning import cost_model
    from calm_lightning.planning.jobs import compose_run, describe
    from calm_lightning.planning.pricing import price

    job = describe(overrides)
    price([job], device, None)
    estimate = job.estimate
    if "peak_gib" not in estimate:
        return [Check("memory", SKIP, estimate.get("basis", "no estimate"))]
    spec = cost_model.get_device(device)
    capacity = spec.memory_gib
    status = PASS if estimate["fits"] else FAIL
    rows = [
        Check(
            "memory",
            status,
            f"planned peak {estimate['peak_gib']:.1f} GiB against {capacity:g} GiB on {device}",
        )
    ]
    launcher = OmegaConf.select(compose_run(overrides, hydra=True), "hydra.launcher")
    limit = launcher.get("timeout_min") if launcher is not None else None
    if limit is None:
        rows.append(Check("time", SKIP, "a local launcher: no time limit"))
        return rows
    requeues = int(launcher.get("max_num_timeout", 0) or 0)
    available = float(limit) * (requeues + 1)
    needed = math.ceil(estimate["total_s"] / 60)
    rows.append(
        Check(
            "time",
            PASS if needed <= available else FAIL,
            f"planned {needed} min against {limit} min x ({requeues} requeues + 1)",
        )
    )
    return rows


def check_revision(cfg) -> Check:
    """A Hub model without a pinned revision reads whatever `main` is at launch: WARN."""
    model = cfg.model
    if model.get("source") != "hub" or model.get("local_path"):
        return Check("revision", PASS, f"not from the Hub ({model.get('source')})")
    revision = model.get("revision")
    if revision in (None, "", "main"):
        return Check(
            "revision",
            WARN,
            f"{model.get('model_id')} is not pinned: set "
            "model.revision=<commit> (docs/hardware.md)",
        )
    return Check("revision", PASS, f"{model.get('model_id')}@{revision}")


def check_job(overrides: list[str], device: str, memo: Memo) -> JobReport:
    """Every check of one job; the first FAIL on `config` leaves the others SKIP."""
    report = JobReport(list(overrides))
    cfg, config = check_config(overrides)
    report.checks.append(config)
    if cfg is None:
        report.checks += [Check(name, SKIP, "the config does not compose") for name in CHECKS[1:]]
        return report
    report.checks += check_data(cfg, memo)
    report.checks += check_tokenizer(cfg, memo)
    report.checks += check_model(cfg, memo)
    report.checks += _guarded("memory", lambda: check_cost(overrides, cfg, device))
    report.checks.append(check_revision(cfg))
    return report


def preflight(target: str, extra: list[str], device: str) -> list[JobReport]:
    """Every job `target` (a sweep script, `+sweep=NAME` or plain overrides) launches,
    checked."""
    from calm_lightning.planning.sweep import expand_call, sweep_calls

    memo, reports = Memo(), []
    for call in sweep_calls(target, extra):
        try:
            jobs, _ = expand_call(call)
        except CalmLightningError as err:
            report = JobReport(list(call), [Check("config", FAIL, _first_line(err))])
            report.checks += [Check(n, SKIP, "the config does not compose") for n in CHECKS[1:]]
            reports.append(report)
            continue
        reports += [check_job(job, device, memo) for job in jobs]
    return reports


def record(reports: list[JobReport]) -> dict:
    """The `--json` record: {"jobs": [{"overrides": [...], "checks": [{name, status, detail}]}]}."""
    return {
        "jobs": [
            {"overrides": r.overrides, "checks": [asdict(c) for c in r.checks]} for r in reports
        ]
    }
