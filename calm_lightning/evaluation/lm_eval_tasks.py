"""The lm-eval tasks a retention evaluation runs (`evaluation.retention`, docs/retention.md):
its settings (`RetentionSettings`), each task's lm-eval definition, and task configs that read
local files in the hub dataset's schema (`evaluation.retention.data_files.<task>`), with errors
that name the task, its hub dataset and the override when its data cannot be had.

lm_eval is imported inside the functions: the config checks read `RetentionSettings` without it.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import yaml

from calm_lightning.config_rules import Either, ListOf, Number, Text, check_values
from calm_lightning.errors import (
    ConfigError,
    DataFormatError,
    DataUnavailableError,
    MissingDependencyError,
)

# The columns of each task's hub dataset, for the message when local files are needed (the
# keys are the paper's five retention tasks).
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
