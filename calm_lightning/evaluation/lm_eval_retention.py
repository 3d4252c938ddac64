"""Language-ability retention: lm-eval-harness tasks (HellaSwag, ARC, WinoGrande, PIQA, ...)
zero-shot on the base model and on the calibrated one, with lm-eval's own task definitions,
prompts, metrics and evaluation loop (docs/retention.md).

What is ours: the model adapter (`lm_eval_model.CalibratedHFLM`), task configs that read local
files in the hub dataset's schema (`evaluation.retention.data_files.<task>`), clear errors when
a task's data cannot be had, and, per task, the calibration of the option distribution lm-eval
scored (softmax over the choices' log-likelihoods) with the project's own conf-ECE.

lm_eval is imported inside the functions: `import calm_lightning` and runs without retention
never pay for it.
"""

from __future__ import annotations

import difflib
import functools
import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
import yaml

from calm_lightning.config_rules import Either, ListOf, Number, Text, check_values
from calm_lightning.errors import (
    ConfigError,
    DataFormatError,
    DataUnavailableError,
    MissingDependencyError,
)
from calm_lightning.metrics.calibration import confidence_ece
from calm_lightning.runtime.run_record import RETENTION_DIR

log = logging.getLogger(__name__)

PAPER_TASKS = ("hellaswag", "arc_easy", "arc_challenge", "winogrande", "piqa")
# The columns of each task's hub dataset, for the message when local files are needed.
SCHEMAS = {
    "piqa": "goal, sol1, sol2, label (0 or 1)",
    "winogrande": "sentence (with one _), option1, option2, answer ('1' or '2')",
    "hellaswag": "activity_label, ctx_a, ctx_b, endings (list), label ('0'..'3')",
    "arc_easy": "id, question, choices {text: [...], label: [...]}, answerKey",
    "arc_challenge": "id, question, choices {text: [...], label: [...]}, answerKey",
}
# `datasets` packaged loaders by file suffix (the same formats as the data modules' files=).
LOADERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "csv"}
SPLIT_KEYS = ("training_split", "validation_split", "test_split", "fewshot_split")
# lm-eval's own default seed for few-shot sampling (zero-shot here, but set as lm-eval does).
FEWSHOT_SEED = 1234


@dataclass(frozen=True)
class RetentionSettings:
    """`evaluation.retention` (conf/run.yaml): which lm-eval tasks, their local files, how many
    documents and how they are batched. `option` is the prefix of the keys errors name
    ("evaluation.retention." in a run, "" for `python -m calm_lightning.retention`)."""

    tasks: tuple[str, ...] = ()
    data_files: dict[str, tuple[str, ...]] = field(default_factory=dict)
    limit: int | None = None
    batch_size: int = 8
    n_bins: int = 10
    option: str = "evaluation.retention."

    # The rules of its keys: checked here and, on the composed config, before any model loads.
    rules: ClassVar[dict] = {
        "tasks": Either((Text(), ListOf(Text())), optional=True),
        "limit": Number(minimum=1, integer=True, optional=True),
        "batch_size": Number(minimum=1, integer=True),
        "n_bins": Number(minimum=1, integer=True),
    }

    @classmethod
    def from_config(cls, node, option: str = "evaluation.retention.") -> RetentionSettings:
        """From the config block (a DictConfig or dict; None = retention off)."""
        from omegaconf import DictConfig, OmegaConf

        if node is None:
            return cls(option=option)
        values = (
            OmegaConf.to_container(node, resolve=True)
            if isinstance(node, DictConfig)
            else dict(node)
        )
        check_values(option.rstrip("."), values, cls.rules)
        tasks = values.get("tasks") or ()
        if isinstance(tasks, str):
            tasks = [tasks]
        files = {
            task: tuple(str(p) for p in ([paths] if isinstance(paths, str) else paths))
            for task, paths in (values.get("data_files") or {}).items()
            if paths
        }
        limit = values.get("limit")
        return cls(
            tasks=tuple(str(t) for t in tasks),
            data_files=files,
            limit=None if limit is None else int(limit),
            batch_size=int(values.get("batch_size", 8)),
            n_bins=int(values.get("n_bins", 10)),
            option=option,
        )

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    def check(self) -> None:
        """Refuse files given for a task that is not run, and duplicated tasks."""
        unused = sorted(set(self.data_files) - set(self.tasks))
        if unused:
            raise ConfigError(
                f"{self.option}data_files names {', '.join(unused)}, which "
                f"{self.option}tasks={list(self.tasks)} does not run"
            )
        if len(set(self.tasks)) != len(self.tasks):
            raise ConfigError(f"{self.option}tasks={list(self.tasks)} names a task twice")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"{self.option}limit={self.limit} must be at least 1 (or null)")


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as err:
        raise MissingDependencyError(
            "evaluation.retention needs lm-eval-harness: pip install -e '.[dev]' (or "
            "pip install 'lm-eval==0.4.13')"
        ) from err


@functools.cache
def task_manager():
    """A TaskManager without lm-eval's index: tasks are loaded from their yaml paths."""
    _require_lm_eval()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=False)


@functools.cache
def _full_index() -> dict:
    """lm-eval's index of all its tasks (reads every task yaml: seconds, so only on need)."""
    from lm_eval.tasks import TaskManager

    return TaskManager().task_index


@functools.cache
def _task_entry_cached(name: str):
    """The index entry of an lm-eval task: first from the folder named like it (`piqa/`, or
    `arc/` for `arc_easy`), which is where lm-eval keeps most tasks, else the full index."""
    import lm_eval.tasks
    from lm_eval.tasks._index import TaskIndex

    root = Path(lm_eval.tasks.__file__).parent
    for guess in dict.fromkeys([name, name.split("_")[0]]):
        if (root / guess).is_dir():
            entry = TaskIndex.build([root / guess]).get(name)
            if entry is not None:
                return entry
    return _full_index().get(name)


def _task_entry(name: str, option: str):
    from lm_eval.tasks._index import Kind

    _require_lm_eval()
    entry = _task_entry_cached(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(_full_index()), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"{option}tasks: {name!r} is not an lm-eval task{hint}")
    if entry.kind not in (Kind.TASK,):
        raise ConfigError(
            f"{option}tasks: {name!r} is an lm-eval {entry.kind.name.lower()}, not a single "
            "task; name its tasks one by one (retention reports one row per task)"
        )
    return entry


def _standard_config(name: str, option: str) -> dict:
    """The task's own yaml, includes merged, functions left unresolved (lm-eval's loader)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(_task_entry(name, option).yaml_path, resolve_func=False)


def hub_dataset(config: dict) -> str:
    """'path' or 'path' (config 'name') of a task's hub dataset, for messages."""
    path, name = config.get("dataset_path"), config.get("dataset_name")
    return f"'{path}'" + (f" (config '{name}')" if name else "")


def eval_split(config: dict) -> str:
    """The split lm-eval evaluates: the test split when the task has one, else validation."""
    split = config.get("test_split") or config.get("validation_split")
    if not split:
        raise ConfigError(f"lm-eval task {config.get('task')!r} has no test or validation split")
    return split


def local_task_config(name: str, files: tuple[str, ...], option: str) -> dict:
    """The standard task (`include` of lm-eval's yaml: prompt, target, choices, metrics,
    process_docs) with its dataset replaced by local files under the split it evaluates."""
    standard = _standard_config(name, option)
    paths = [Path(f).expanduser() for f in files]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise ConfigError(f"{option}data_files.{name}: no such file {', '.join(missing)}")
    suffixes = {p.suffix.lower() for p in paths}
    if len(suffixes) != 1 or next(iter(suffixes)) not in LOADERS:
        raise ConfigError(
            f"{option}data_files.{name}: files must share one format of "
            f"{', '.join(sorted(LOADERS))} (got {', '.join(sorted(suffixes))})"
        )
    suffix = next(iter(suffixes))
    split = eval_split(standard)
    kwargs: dict = {"data_files": {split: [str(p.resolve()) for p in paths]}}
    if suffix == ".tsv":
        kwargs["delimiter"] = "\t"
    config = {
        "include": str(_task_entry(name, option).yaml_path),
        "task": name,
        "dataset_path": LOADERS[suffix],
        "dataset_name": None,  # a hub config name means nothing to the packaged loaders
        "dataset_kwargs": kwargs,
    }
    # Only the evaluated split exists locally; zero-shot needs no other.
    for key in SPLIT_KEYS:
        if standard.get(key) and standard.get(key) != split:
            config[key] = None
    return config


def task_specs(settings: RetentionSettings, workdir: Path) -> dict[str, str]:
    """Per task, the yaml lm-eval loads: the task's own, or a generated one (kept in `workdir`
    as a record of what ran) when the task reads local files."""
    specs = {}
    for name in settings.tasks:
        files = settings.data_files.get(name)
        if not files:
            specs[name] = str(_task_entry(name, settings.option).yaml_path)
            continue
        config = local_task_config(name, files, settings.option)
        workdir.mkdir(parents=True, exist_ok=True)
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        specs[name] = str(path)
    return specs


def _unavailable(name: str, config: dict, option: str, reason: str) -> str:
    split = eval_split(config)
    schema = SCHEMAS.get(name, "the hub dataset's own columns")
    return (
        f"Cannot load the data of lm-eval task '{name}': it reads the Hugging Face dataset "
        f"{hub_dataset(config)}, split '{split}', and {reason}\n"
        "Either:\n"
        f"  * pass local files in that dataset's schema ({schema}): "
        f"{option}data_files.{name}=[/data/{name}_{split}.jsonl] (json, jsonl, csv, tsv or "
        "parquet); or\n"
        "  * pre-populate the Hugging Face cache on a machine with network (HF_HOME=...), copy "
        "it here and set HF_HOME to it (HF_DATASETS_OFFLINE=1 then never tries the network)."
    )


def load_tasks(settings: RetentionSettings, workdir: Path) -> dict:
    """lm-eval Task objects for `settings.tasks` (their data read now, before any model
    loads); errors name the task, its hub dataset and the override for local files."""
    _require_lm_eval()
    settings.check()
    specs = task_specs(settings, workdir)
    manager = task_manager()
    tasks = {}
    for name, spec in specs.items():
        try:
            loaded = manager.load([spec])["tasks"]
        except Exception as err:  # offline, unreachable, bad files: many exception classes
            standard = _standard_config(name, settings.option)
            reason = f"{type(err).__name__}: {err}"
            if name not in settings.data_files:
                raise DataUnavailableError(
                    _unavailable(name, standard, settings.option, f"that failed ({reason}).")
                ) from err
            files = ", ".join(settings.data_files[name])
            raise DataFormatError(
                f"lm-eval task '{name}' could not use {settings.option}data_files.{name} "
                f"({files}): {reason}\nThe files must hold the split '{eval_split(standard)}' "
                f"of {hub_dataset(standard)} in its own schema: "
                f"{SCHEMAS.get(name, 'the hub dataset columns')}."
            ) from err
        tasks[name] = loaded[name]
    return tasks


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Leave Python's, numpy's and torch's random streams as they were: a retention pass in
    the middle of a run must not change what training draws afterwards."""
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.random.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_lm_eval(calibrated, tokenizer, tasks: dict, settings: RetentionSettings) -> dict:
    """lm-eval's `evaluate` on `tasks` with the calibrated model, zero-shot; its raw result
    (per-task metrics and per-sample outputs)."""
    from lm_eval.evaluator import evaluate

    from calm_lightning.evaluation.lm_eval_model import CalibratedHFLM

    base = (
        calibrated.lm.get_base_model()
        if hasattr(calibrated.lm, "get_base_model")
        else calibrated.lm
    )
    if not getattr(base, "is_loaded_in_4bit", False):  # 4-bit weights stay where they were put
        calibrated.to(_device())
    for task in tasks.values():
        # What lm-eval's `simple_evaluate` does per task: zero-shot, seeded few-shot sampler.
        task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    with preserved_rng():
        lm = CalibratedHFLM(calibrated, tokenizer, batch_size=settings.batch_size)
        # `evaluate` rather than `simple_evaluate`: the latter adds a reproducibility block
        # that asks the Hub for a model SHA and collects environment info in subprocesses;
        # the run records its own.
        return evaluate(
            lm=lm,
            task_dict={"tasks": tasks, "groups": {}, "group_map": {}},
            limit=settings.limit,
            bootstrap_iters=0,
            log_samples=True,
        )


def gold_index(task, doc: dict) -> int | None:
    """The index of the correct choice, by lm-eval's rule for multiple-choice results
    (`ConfigurableTask.process_results`): doc_to_text when the choices are contexts
    (WinoGrande), else doc_to_target, a choice's text mapped to its index. None when the
    task has several gold answers (no single option distribution label)."""
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, list):
        return None
    if isinstance(gold, str):
        choices = task.doc_to_choice(doc)
        return choices.index(gold) if gold in choices else None
    return int(gold)


def option_distribution(task, samples: list[dict]) -> tuple[np.ndarray, np.ndarray] | None:
    """(N, K) softmax over each document's choice log-likelihoods (zero-padded where tasks
    mix option counts, as ARC does) and (N,) gold indices; None for tasks that do not score
    choices or have several gold answers."""
    if task.OUTPUT_TYPE != "multiple_choice":
        return None
    rows, labels = [], []
    for sample in samples:
        lls = np.array([float(ll) for ll, _ in sample["filtered_resps"]], dtype=np.float64)
        gold = gold_index(task, sample["doc"])
        if gold is None:
            return None
        probs = np.exp(lls - lls.max())
        rows.append(probs / probs.sum())
        labels.append(gold)
    width = max(len(r) for r in rows)
    padded = np.zeros((len(rows), width))
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row  # zero probability on absent options: ECE unchanged
    return padded, np.array(labels, dtype=np.int64)


def task_row(task, result: dict, samples: list[dict], n_bins: int) -> dict:
    """acc (and acc_norm where the task has it) as lm-eval computed them, n, and the conf-ECE
    and mean confidence of the option distribution."""
    row = {"n": len(samples)}
    for metric in ("acc", "acc_norm"):
        if f"{metric},none" in result:
            row[metric] = float(result[f"{metric},none"])
    distribution = option_distribution(task, samples)
    if distribution is not None:
        probs, labels = distribution
        row["conf_ece"] = confidence_ece(probs, labels, n_bins=n_bins)
        row["mean_confidence"] = float(probs.max(1).mean())
    return row


def evaluate_retention(
    calibrated, tokenizer, tasks: dict, settings: RetentionSettings, samples_dir: Path | None = None
) -> dict[str, dict]:
    """One retention row: per task {acc, acc_norm, n, conf_ece, mean_confidence}. With
    `samples_dir`, each task's per-document log-likelihoods go to <samples_dir>/<task>.jsonl."""
    raw = run_lm_eval(calibrated, tokenizer, tasks, settings)
    row = {}
    for name, task in tasks.items():
        samples = raw["samples"][name]
        row[name] = task_row(task, raw["results"][name], samples, settings.n_bins)
        if samples_dir is not None:
            write_samples(samples_dir / f"{name}.jsonl", task, samples)
    return row


def write_samples(path: Path, task, samples: list[dict]) -> None:
    """Per document: its id, the choices' log-likelihoods, the gold index, acc, acc_norm."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as handle:
        for sample in samples:
            record = {
                "doc_id": sample["doc_id"],
                "loglikelihoods": [float(ll) for ll, _ in sample["filtered_resps"]],
                "gold": gold_index(task, sample["doc"])
                if task.OUTPUT_TYPE == "multiple_choice"
                else None,
                **{k: sample[k] for k in ("acc", "acc_norm") if k in sample},
            }
            handle.write(json.dumps(record) + "\n")


def retention_record(rows: dict[str, dict], settings: RetentionSettings, meta: dict) -> dict:
    """retention.json's content: the settings, lm-eval's version and one row per model."""
    from importlib.metadata import version

    return {
        **meta,
        "lm_eval_version": version("lm_eval"),
        "num_fewshot": 0,
        "tasks": list(settings.tasks),
        "limit": settings.limit,
        "data_files": {k: list(v) for k, v in settings.data_files.items()},
        "rows": rows,
    }


class RetentionStep:
    """Retention as one evaluation step of a run: the tasks' data are read when the step is
    made (before any model loads), then `evaluate` adds a row per model (the untouched base
    first, then the method's) under `out`'s retention/ folder."""

    def __init__(self, settings: RetentionSettings, out: str | Path) -> None:
        self.settings, self.out = settings, Path(out)
        self.tasks = load_tasks(settings, self.out / RETENTION_DIR) if settings.enabled else {}
        self.rows: dict[str, dict] = {}

    @classmethod
    def from_config(cls, node, out: str | Path) -> RetentionStep:
        return cls(RetentionSettings.from_config(node), out)

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)

    def evaluate(self, name: str, lm, tokenizer) -> dict:
        self.rows[name] = evaluate_retention(
            lm, tokenizer, self.tasks, self.settings, self.out / RETENTION_DIR / name
        )
        return self.rows[name]

    def record(self, meta: dict) -> dict:
        return retention_record(self.rows, self.settings, meta)

    def table(self) -> str:
        return format_retention_table(self.rows)


def format_retention_table(rows: dict[str, dict]) -> str:
    """Plain-text table: one line per (model row, task) with acc, acc_norm, conf-ECE, n."""
    header = f"{'model':<14}{'task':<16}{'acc':>8}{'acc_norm':>10}{'conf-ECE':>10}{'n':>7}"
    lines = [header, "-" * len(header)]

    def cell(value, percent=False):
        if value is None:
            return "-"
        return f"{100 * value:.2f}" if percent else f"{value:.4f}"

    for name, tasks in rows.items():
        for task, m in tasks.items():
            lines.append(
                f"{name:<14}{task:<16}{cell(m.get('acc'), True):>8}"
                f"{cell(m.get('acc_norm'), True):>10}{cell(m.get('conf_ece')):>10}{m['n']:>7}"
            )
    return "\n".join(lines)
