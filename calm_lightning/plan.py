"""What a sweep will launch, and what it will cost, before it runs.

    python -m calm_lightning.plan multirun_sweeps/table1_mcqa_ood.sh model=olmo2
    python -m calm_lightning.plan +sweep=calm_ood model=olmo2 --device h200 --json plan.json

A sweep script is run for real with a recording stand-in for Python (`--python`), so the jobs
listed are the `python -m calm_lightning.run` calls the script makes, with its loops and
helpers; each call is expanded into jobs by Hydra's own basic sweeper (the grid of its
`+sweep=` file plus the command line's comma lists), and each job's config is composed like
`calm_lightning.run` composes it. Every job gets GPU-hours and a peak memory on `--device` from
the cost model (cost_model.py: FLOPs from the model's shape and the passes its method makes,
over the device's peak x a stated utilisation; plan_costs.py: the passes per method). A cost
file measured on a GPU (`benchmarks/calm_step.py --json`, `--costs FILE`) replaces the stated
utilisation with the measured one; one whose phases are out of order is refused.

An epoch is what the job's data module yields (`batches_per_epoch`): under the default
`budget=paper` an epoch of the bilevel methods (CALM, Iterate) is 20 batches, the paper's
Appendix C.2 read as Table 10's costs need it (docs/calm.md, "Reading of the paper"); under
`budget=full` every batch. The plan names the budget it priced and prints the total under each
other budget (every job composed again with `budget=` swapped), so the choice is visible before
launch. The base model's evaluation is charged once per base-cache entry (`base_cache_key`):
later jobs of a sweep read its row. The planner never imports torch.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from omegaconf import OmegaConf

from calm_lightning import cost_model, plan_costs
from calm_lightning.errors import ConfigError
from calm_lightning.models.lora import checkpointing_enabled
from calm_lightning.models.shapes import Shape, parameter_count
from calm_lightning.runtime.base_cache import NOT_MODEL, NOT_SCORING

# Head-room on the longest job's estimate for a SLURM time limit: the estimate is an upper
# bound on tokens but assumes a utilisation, and a job killed at its limit loses its work.
SLURM_MARGIN = 0.25
CONF_PACKAGE = "calm_lightning.conf"  # the config tree (top-level conf/ in a checkout)
CALM_METHODS = plan_costs.CALM_METHODS  # the bilevel presets (one LightningModule, calm.py)
_RECORDER = """#!{python}
import json, os, sys
with open(os.environ["CALM_PLAN_LOG"], "a") as log:
    log.write(json.dumps(sys.argv[1:]) + "\\n")
"""


@dataclass
class Job:
    """One job of a sweep: its overrides and what its composed config says it will do."""

    overrides: list[str]
    method: str
    model: str
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
    lora_r: int = 0
    checkpointing: bool = False
    sampling: tuple[int, int] | None = None  # open QA: (samples, max new tokens) per question
    train_source: str | None = None  # the training data's source class (plan_costs widths)
    reference_shape: Shape | None = None  # post-hoc methods' pre-trained reference model
    reference_quantized: bool = False
    estimate: dict = field(default_factory=dict)


def sweep_calls(target: str, extra: list[str]) -> list[list[str]]:
    """The override lists of every `calm_lightning.run` call `target` makes: a sweep script
    (run with a recording Python) or `+sweep=...` (one call)."""
    if not target.endswith(".sh"):
        return [[target, *extra]]
    script = Path(target)
    if not script.is_file():
        raise ConfigError(f"no sweep script at {target}")
    script_args, models = [], []
    for arg in extra:  # the scripts take models as --model (they set model= themselves)
        if arg.startswith("model="):
            models.append(arg.removeprefix("model="))
        else:
            script_args.append(arg)
    if models:
        script_args = ["--model", ",".join(models), *script_args]
    with tempfile.TemporaryDirectory(prefix="calm-plan-") as tmp:
        recorder, log = Path(tmp, "python"), Path(tmp, "calls.jsonl")
        recorder.write_text(_RECORDER.format(python=sys.executable))
        recorder.chmod(0o755)
        done = subprocess.run(
            ["bash", str(script), "--python", str(recorder), "--out", str(Path(tmp, "out")),
             *script_args],
            capture_output=True, text=True, env=dict(os.environ, CALM_PLAN_LOG=str(log)),
            check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise ConfigError(f"{target} {' '.join(script_args)} refused:\n{done.stderr}")
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    runs = [c[2:] for c in calls if c[:2] == ["-m", "calm_lightning.run"]]
    if not runs:
        raise ConfigError(f"{target} makes no `python -m calm_lightning.run` call")
    return runs


def expand(overrides: list[str]) -> list[list[str]]:
    """The jobs one `calm_lightning.run` call launches, by Hydra's basic sweeper: the grid
    in `hydra.sweeper.params` followed by the command line's task overrides."""
    return expand_call(overrides)[0]


def expand_call(overrides: list[str]) -> tuple[list[list[str]], bool]:
    """`expand`'s jobs, and whether they run as a multirun (one sweep folder, whose base cache
    the jobs share) rather than as one run in its own folder."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    flag = any(o in ("--multirun", "-m") for o in overrides)
    overrides = [o for o in overrides if o not in ("--multirun", "-m")]
    parser = OverridesParser.create()
    parsed = _parse(parser, overrides)
    task = [o.input_line for o in parsed if not o.get_key_element().startswith("hydra.")]
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    hydra_cfg = _compose(fixed, hydra=True).hydra
    sweeper = str(hydra_cfg.sweeper.get("_target_", ""))
    if not sweeper.endswith("BasicSweeper"):
        raise ConfigError(
            f"{' '.join(overrides)}: the sweeper is {sweeper}, whose jobs are chosen while it "
            "runs (e.g. Optuna's n_trials); only the basic sweeper's grids can be listed"
        )
    params = [f"{k}={v}" for k, v in (hydra_cfg.sweeper.get("params") or {}).items()]
    multirun = hydra_cfg.mode == RunMode.MULTIRUN or flag
    if not multirun and not any(o.is_sweep_override() for o in parsed):
        return [task], False
    (jobs,) = BasicSweeper.split_arguments(_parse(parser, params + task), None)
    return jobs, True


def _parse(parser, overrides: list[str]):
    """Hydra's parse of `overrides`; a malformed one as a one-line ConfigError."""
    from hydra.errors import HydraException

    try:
        return parser.parse_overrides(overrides)
    except HydraException as err:
        first = str(err).splitlines()[0]
        raise ConfigError(f"{' '.join(overrides)}: not an override Hydra reads ({first})") from err


def _compose(overrides: list[str], hydra: bool = False):
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
    cfg = _compose(overrides)
    select = OmegaConf.select
    setting, trainer, module = cfg.setting, cfg.trainer, cfg.method.get("module") or {}
    job = Job(
        overrides=overrides,
        method=str(cfg.method.name),
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
    if epochs and job.method not in ("base", "ts"):
        job.epochs = int(epochs)
        job.epoch_batches = batches_per_epoch(
            job.train_rows, job.batch, select(cfg, "method.epoch_batches", default=None),
            trainer.get("limit_train_batches"),
        )  # fmt: skip
        job.train_steps = job.epochs * job.epoch_batches
        if int(trainer.get("max_steps", -1)) > 0:
            job.train_steps = min(job.train_steps, int(trainer.max_steps))
    if job.method in CALM_METHODS:
        job.schedule = str(select(cfg, "method.module.surrogate.schedule", default="per_step"))
        job.inner_steps = int(module.get("inner_steps", 1))
        job.surrogate_steps = int(select(cfg, "method.module.surrogate.steps", default=1))
    if job.method == "iterate":
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
    """What the job's cached base row depends on (runtime/base_cache.py's fingerprint, as far
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
    job.quantized = str(model.get("quantization", "auto")) in ("auto", "nf4")  # auto: nf4 on GPU
    job.lora_r = int(select(cfg, "peft.r", default=0) or 0)
    job.checkpointing = checkpointing_enabled(
        select(cfg, "peft.gradient_checkpointing", default=False),
        parameter_count(job.shape) if job.shape is not None else 0,
    )
    train_target = str(select(cfg, "setting.train._target_", default="") or "")
    job.train_source = train_target.rsplit(".", 1)[-1] or None
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
        job.reference_quantized = str(ref.get("quantization", "none")) == "nf4"


def _model_label(name, shape) -> str:
    return f"{name} (shape {shape})" if shape else str(name)


def plan(target: str, extra: list[str], device: str | None = None,
         costs: dict | None = None) -> list[Job]:  # fmt: skip
    """Every job `target` launches (in launch order), each with its estimate on `device`
    (default: the local GPU, else the A100 40G); `costs` (a GPU cost file) replaces the
    assumed utilisation with the measured one."""
    device = device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = []
    for index, call in enumerate(sweep_calls(target, extra)):
        expanded, multirun = expand_call(call)
        sweep = _sweep_folder(call, index) if multirun else None
        jobs += [describe(job, sweep) for job in expanded]
    price(jobs, device, measured)
    return jobs


def _sweep_folder(call: list[str], index: int) -> str:
    """The folder a multirun call's jobs share: its `hydra.sweep.dir`, else (the default
    folder is stamped with the launch time) one of its own."""
    for override in reversed(call):
        if override.startswith("hydra.sweep.dir="):
            return override.split("=", 1)[1]
    return f"call {index}"


def price(jobs: list[Job], device: str, measured: dict | None) -> None:
    """Each job's estimate; a job whose base-cache entry an earlier job wrote reads that row
    (`base_read_from`) and is charged no base-model evaluation."""
    first: dict[str, int] = {}
    for index, job in enumerate(jobs):
        job.base_read_from = None
        if job.base_key is not None and job.train_steps:
            job.base_read_from = first.setdefault(job.base_key, index)
            if job.base_read_from == index:
                job.base_read_from = None
        job.estimate = plan_costs.estimate(job, device, measured)


def other_budgets(jobs: list[Job], device: str, measured: dict | None) -> dict[str, float]:
    """The sweep's total GPU-hours under each other option of conf/budget/: every job composed
    again with `budget=` swapped (the rest of its overrides as they are)."""
    used = {j.budget for j in jobs}
    if None in used:  # a config tree without the budget group
        return {}
    totals = {}
    for name in group_options("budget"):
        if used == {name}:
            continue
        swapped = []
        for job in jobs:
            overrides = [o for o in job.overrides if not o.startswith("budget=")]
            swapped.append(describe([*overrides, f"budget={name}"], _sweep_of(job)))
        price(swapped, device, measured)
        totals[name] = sum(j.estimate.get("gpu_hours", 0.0) for j in swapped)
    return totals


def _sweep_of(job: Job) -> str | None:
    """The sweep folder a described job was given (kept in its base-cache key)."""
    return json.loads(job.base_key)["folder"] if job.base_key else None


def budget_line(jobs: list[Job]) -> str:
    """Which budget the plan priced, and what it means for the epochs."""
    budgets = sorted({(j.budget, j.bilevel_epoch_batches) for j in jobs}, key=str)
    if budgets == [(None, None)]:
        return "budget: none (no conf/budget group): every epoch is every batch"
    parts = []
    for name, size in budgets:
        if size:
            parts.append(
                f"budget: {name} (bilevel epochs of {size} batches: an epoch of CALM and Iterate "
                f"is {size} training batches, as the paper's Appendix C.2 and Table 10 read; "
                "the other methods run every batch)"
            )
        else:
            parts.append(f"budget: {name} (every method's epoch is every batch)")
    return "; ".join(parts)


def _hours(seconds) -> str:
    if seconds is None:
        return "?"
    return f"{seconds / 3600:.2f} h" if seconds >= 360 else f"{seconds:.0f} s"


def print_plan(jobs: list[Job], device: str, measured: dict | None, costs=None,
               others: dict[str, float] | None = None) -> None:  # fmt: skip
    """The plan as text; `others`: the sweep's total under each other budget."""
    common = set.intersection(*(set(j.overrides) for j in jobs)) if jobs else set()
    spec = cost_model.get_device(device)
    print(f"{len(jobs)} jobs; every job has: {' '.join(sorted(common))}")
    print(
        f"device: {device} ({spec.label}: {spec.peak_tflops:g} TFLOP/s bf16 dense, "
        f"{spec.memory_gib:g} GiB); cost model: calm_lightning/cost_model.py"
    )
    print(budget_line(jobs))
    if measured:
        print(
            f"utilisation measured on {measured['file_device']}: training "
            f"{measured['train']:.0%}" + (f", forward {measured['eval']:.0%}" if "eval" in measured
                                          else "")
        )  # fmt: skip
        for line in plan_costs.calm_ratios(costs or {}):
            print(f"  {line}")
    print()
    for index, job in enumerate(jobs):
        own = " ".join(o for o in job.overrides if o not in common)
        epochs = f" ({job.epochs} x {job.epoch_batches})" if job.train_steps else ""
        print(f"#{index:<3d} {job.method:8s} steps {job.train_steps:6d}{epochs}  {own}")
        e = job.estimate
        if "gpu_hours" not in e:
            print(f"      no estimate: {e['basis']}")
            continue
        step = f"{e['step_s']:.2f} s/step, " if job.train_steps else ""
        fits = "" if e["fits"] else f"  DOES NOT FIT {spec.memory_gib:g} GiB"
        print(
            f"      {step}{e['gpu_hours']:.2f} GPU-h (train {_hours(e['train_s'])}, eval "
            f"{_hours(e['eval_s'])}), peak {e['peak_gib']:.1f} GiB{fits}"
        )
        if job.base_read_from is not None:
            print(f"      base model: read from #{job.base_read_from}'s base cache, not scored")
        if "checkpointed_peak_gib" in e:
            print(
                f"      with peft.gradient_checkpointing=true: peak "
                f"{e['checkpointed_peak_gib']:.1f} GiB (one more forward per pass)"
            )
        if "uncheckpointed" in e:
            print(
                f"      fits without checkpointing (peft.gradient_checkpointing=false): "
                f"{e['uncheckpointed']['step_s']:.2f} s/step, peak "
                f"{e['uncheckpointed']['peak_gib']:.1f} GiB"
            )
        paper = plan_costs.paper_comparison(job, e)
        if paper:
            print(f"      {paper}")
    known = [j.estimate["gpu_hours"] for j in jobs if "gpu_hours" in j.estimate]
    print()
    if not known:
        print("total: no estimate")
        return
    peak = max(j.estimate["peak_gib"] for j in jobs if "peak_gib" in j.estimate)
    print(
        f"total: {sum(known):.1f} GPU-hours on {device} for {len(known)} of {len(jobs)} "
        f"jobs; largest peak {peak:.1f} GiB"
    )
    for name, hours in (others or {}).items():
        print(f"  with budget={name}: {hours:.1f} GPU-hours (the same jobs, budget swapped)")
    print(base_cache_line(jobs))
    slurm = slurm_suggestion(max(known), jobs)
    print(
        f"SLURM (hydra/launcher=slurm): hydra.launcher.timeout_min={slurm['timeout_min']} "
        f"covers the longest job with a {SLURM_MARGIN:.0%} margin; at the launcher's "
        f"{slurm['limit_min']}-minute limit instead, hydra.launcher.max_num_timeout="
        f"{slurm['max_num_timeout']} (ceil({slurm['timeout_min']} / {slurm['limit_min']}) "
        "requeues, each resuming from the last checkpoint)"
    )


def base_cache_line(jobs: list[Job]) -> str:
    """How often the plan charges the base model's evaluation (`compare_with_base`)."""
    training = [j for j in jobs if j.train_steps and j.compare_with_base]
    if not training:
        return "base model: no training job compares with it"
    scored = [j for j in training if j.base_read_from is None]
    cached = len({j.base_key for j in training if j.base_key is not None})
    return (
        f"base model: scored by {len(scored)} of {len(training)} training jobs "
        f"({cached} base-cache entries; evaluation.base_cache: the other jobs of a sweep with "
        "the same model, test data and scoring read the first one's row)"
    )


def slurm_limit_min(jobs: list[Job]) -> int:
    """The SLURM launcher's wall-clock limit per job: a `hydra.launcher.timeout_min=` every
    job passes, else conf/hydra/launcher/slurm.yaml's."""
    given = {o.split("=", 1)[1] for j in jobs for o in j.overrides
             if o.startswith("hydra.launcher.timeout_min=")}  # fmt: skip
    if len(given) == 1 and all(
        any(o.startswith("hydra.launcher.timeout_min=") for o in j.overrides) for j in jobs
    ):
        return int(given.pop())
    launcher = resources.files(CONF_PACKAGE).joinpath("hydra", "launcher", "slurm.yaml")
    return int(OmegaConf.create(launcher.read_text()).timeout_min)


def slurm_suggestion(longest_gpu_hours: float, jobs: list[Job]) -> dict:
    """Two ways to run the longest job under SLURM, from the same estimate with the margin: a
    limit that covers it (`timeout_min`), or the launcher's limit with as many requeues as it
    takes limits (`max_num_timeout`: ceil(that time / limit); each requeue resumes from the
    last checkpoint, and counting whole limits leaves room for the work lost at each cut)."""
    needed = slurm_timeout_min(longest_gpu_hours)
    limit = slurm_limit_min(jobs)
    return {"timeout_min": needed, "limit_min": limit, "max_num_timeout": math.ceil(needed / limit)}


def plan_record(jobs: list[Job], device: str, measured: dict | None,
                others: dict[str, float] | None = None) -> dict:  # fmt: skip
    """The plan as json: one record per job, the device, the budget and the totals."""
    records = [
        {
            "method": j.method,
            "model": j.model,
            "overrides": j.overrides,
            "steps": j.train_steps,
            "epochs": j.epochs,
            "epoch_batches": j.epoch_batches,
            "base_read_from": j.base_read_from,
            **{
                k: j.estimate.get(k)
                for k in (
                    "step_s",
                    "train_s",
                    "eval_s",
                    "gpu_hours",
                    "peak_gib",
                    "fits",
                    "utilisation",
                    "basis",
                )
            },
        }  # fmt: skip
        for j in jobs
    ]
    hours = [r["gpu_hours"] for r in records if r["gpu_hours"] is not None]
    peaks = [r["peak_gib"] for r in records if r["peak_gib"] is not None]
    slurm = slurm_suggestion(max(hours), jobs) if hours else {}
    return {
        "device": device,
        "device_spec": vars(cost_model.get_device(device)),
        "utilisation": measured or {"assumed": cost_model.UTILISATION},
        "budget": sorted({j.budget for j in jobs}, key=str),
        "budget_line": budget_line(jobs),
        "jobs": records,
        "total_gpu_hours": sum(hours),
        "other_budgets_gpu_hours": others or {},
        "base_model_scored_by": sum(
            1 for j in jobs if j.train_steps and j.compare_with_base and j.base_read_from is None
        ),
        "max_peak_gib": max(peaks) if peaks else None,
        "slurm_timeout_min": slurm.get("timeout_min"),
        "slurm_limit_min": slurm.get("limit_min"),
        "max_num_timeout": slurm.get("max_num_timeout"),
    }


def slurm_timeout_min(gpu_hours: float) -> int:
    """A SLURM wall-clock limit for a one-GPU job of `gpu_hours`, with the margin."""
    return math.ceil(gpu_hours * 60 * (1 + SLURM_MARGIN))


def add_arguments(parser) -> None:
    parser.add_argument("target", help="a multirun_sweeps/*.sh script or +sweep=NAME")
    parser.add_argument("overrides", nargs="*", help="model=NAME and other key=value overrides")
    parser.add_argument(
        "--device", choices=sorted(cost_model.DEVICES),
        help="the GPU to plan for (default: the local GPU, else a100_40g)",
    )  # fmt: skip
    parser.add_argument(
        "--costs", help="json from benchmarks/calm_step.py --json on a GPU: measured utilisation"
    )
    parser.add_argument("--json", metavar="FILE", help="also write the plan here")


def command(args, parser) -> int:
    """Print the jobs of `args.target` with their estimates."""
    costs = json.loads(Path(args.costs).read_text()) if args.costs else None
    device = args.device or cost_model.default_device()
    measured = cost_model.calibrate(costs) if costs else None
    jobs = plan(args.target, args.overrides, device, costs)
    others = other_budgets(jobs, device, measured)
    print(f"plan: {args.target} {shlex.join(args.overrides)}")
    print_plan(jobs, device, measured, costs, others)
    if args.json:
        record = plan_record(jobs, device, measured, others)
        record["command"] = shlex.join(["python", "-m", "calm_lightning.plan", args.target,
                                        *args.overrides, "--device", device])  # fmt: skip
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.plan`: the same as `python -m calm_lightning plan`."""
    from calm_lightning.cli import command_main

    return command_main("plan", argv)


if __name__ == "__main__":
    raise SystemExit(main())
