"""`python -m calm_lightning.retention run_dir=<run dir> [tasks=[piqa,winogrande,...]]
[data_files.<task>=[file,...]] [limit=N] [batch_size=8] [out=<dir>] [overwrite=false]`:
language-ability retention of a saved run, without retraining.

The run's base model is loaded as `python -m calm_lightning.export` loads it (same checks, same
precision), scored zero-shot on the lm-eval tasks, then the run's calibration/ (adapter + head
or temperature) is attached and the same tasks are scored again. Writes <out>/retention.json
(out defaults to run_dir, where the sweep report finds it) and prints the table. Tasks and
data files default to the run's own `evaluation.retention` block; docs/retention.md has more.

`run_dir` may also be a folder written by `python -m calm_lightning.export`: its calibrated
model is scored as served (one `export` row; `tasks=` is then required, there is no run
config to read them from), so an export can be checked against its run's retention and
against lm-eval's own `hf` model on the same folder.

Arguments are key=value like a run's command line (lists as [a,b] or a,b), read by the
shared argument readers (arguments.py) rather than Hydra: there is nothing to compose.
"""

from __future__ import annotations

import logging
from pathlib import Path

from calm_lightning.arguments import key_value_arguments, parse_bool, parse_list
from calm_lightning.errors import ConfigError

log = logging.getLogger(__name__)

# A long single action: show the project's INFO log lines (arguments.invoke).
LOGS_PROGRESS = True

USAGE = (
    "usage: python -m calm_lightning.retention run_dir=<run dir> [tasks=[piqa,winogrande]] "
    "[data_files.<task>=[/data/<task>.jsonl]] [limit=N] [batch_size=8] [out=<dir>] "
    "[overwrite=false] [trust_remote_code=false]"
)
KEYS = (
    "run_dir",
    "tasks",
    "data_files",
    "limit",
    "batch_size",
    "n_bins",
    "out",
    "overwrite",
    "trust_remote_code",
)


def parse_arguments(argv: list[str]) -> dict:
    """key=value arguments into a plain dict: lists for tasks and data files, numbers, a bool."""
    values: dict = {}
    for key, text in key_value_arguments(argv, KEYS, USAGE, nested=("data_files",)).items():
        if key.startswith("data_files."):
            values.setdefault("data_files", {})[key.removeprefix("data_files.")] = parse_list(
                text, key
            )
        elif key == "tasks":
            values[key] = parse_list(text, key)
        elif key in ("limit", "batch_size", "n_bins"):
            values[key] = _integer(key, text)
        elif key in ("overwrite", "trust_remote_code"):
            values[key] = parse_bool(text, key)
        else:
            values[key] = text
    if not values.get("run_dir"):
        raise ConfigError(f"missing run_dir=\n{USAGE}")
    return values


def _integer(key: str, text: str) -> int | None:
    """A whole number; `limit` may also be null (every document)."""
    if key == "limit" and text.strip().lower() in ("null", "none"):
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{key}={text!r} is not a whole number\n{USAGE}") from None


def settings_for(run_cfg, arguments: dict):
    """The run's own `evaluation.retention` block, then the command line on top."""
    from omegaconf import OmegaConf

    from calm_lightning.evaluation.lm_eval_tasks import RetentionSettings

    block = (
        None if run_cfg is None else OmegaConf.select(run_cfg, "evaluation.retention", default=None)
    )
    values = OmegaConf.to_container(block, resolve=True) if block is not None else {}
    if run_cfg is not None:
        values.setdefault("n_bins", OmegaConf.select(run_cfg, "evaluation.n_bins", default=10))
    for key in ("tasks", "limit", "batch_size", "n_bins"):
        if key in arguments:
            values[key] = arguments[key]
    tasks = values.get("tasks") or []
    # Files the run named for tasks this evaluation does not run are no error here (those
    # given on the command line are).
    files = {k: v for k, v in (values.get("data_files") or {}).items() if v and k in tasks}
    values["data_files"] = {**files, **(arguments.get("data_files") or {})}
    settings = RetentionSettings.from_config(values, option="")
    if not settings.enabled:
        raise ConfigError(f"no retention tasks: pass tasks=[piqa,winogrande,...]\n{USAGE}")
    return settings


def evaluate_run(
    run_dir: str | Path,
    arguments: dict | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
) -> Path:
    """Retention of the saved run in `run_dir` (base row, then the method's when it changes
    the model); returns the retention.json it wrote. The run folder is read as data
    (exported/saved_run.py): the base model's Hub code runs only with `trust_remote_code`."""
    from calm_lightning.evaluation.lm_eval_retention import RetentionStep
    from calm_lightning.evaluation.results import run_meta
    from calm_lightning.exported.saved_run import inspect_run, load_base_model, target_dtype
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.models.logits_processor import CALIBRATION_FILE
    from calm_lightning.runtime.run_record import is_run_dir, write_retention

    if not is_run_dir(run_dir) and (Path(run_dir) / CALIBRATION_FILE).is_file():
        return evaluate_export(run_dir, arguments, out, overwrite)
    run = inspect_run(run_dir, exporting=False)
    out = Path(out) if out else run.run_dir
    _check_target(out, overwrite)
    # Data first: a missing file stops before the model loads.
    retention = RetentionStep(settings_for(run.cfg, arguments or {}), out)
    loaded = load_base_model(run, target_dtype(run), trust_remote_code)
    retention.evaluate("base", CalibratedLM(loaded.model, None), loaded.tokenizer)
    if run.method_class.changes_model:
        calibrated = CalibratedLM.load(loaded.model, run.calibration_dir).eval()
        retention.evaluate(run.method, calibrated, loaded.tokenizer)
    # The run folder's name, not its path: retention.json is shared, the machine's folders not.
    meta = {**run_meta(run.cfg), "run_dir": run.run_dir.resolve().name, "source": "saved run"}
    path = write_retention(out, retention.record(meta))
    print(f"\nretention of {run.run_dir} (lm-eval, zero-shot; {path})")
    print(retention.table())
    return path


def evaluate_export(
    folder: str | Path,
    arguments: dict | None = None,
    out: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """Retention of an exported folder, scored as `load_calibrated` serves it (the folded
    weights, or the weights plus the folder's head): one `export` row."""
    from calm_lightning.evaluation.lm_eval_retention import RetentionStep
    from calm_lightning.exported.inference import load_calibrated
    from calm_lightning.models.calibrated_lm import CalibratedLM
    from calm_lightning.runtime.run_record import write_retention

    folder = Path(folder)
    out = Path(out) if out else folder
    _check_target(out, overwrite)
    retention = RetentionStep(settings_for(None, arguments or {}), out)
    calibrated = load_calibrated(folder)
    lm = CalibratedLM(calibrated.model, calibrated.processor.head).eval()
    retention.evaluate("export", lm, calibrated.tokenizer)
    meta = {
        "method": calibrated.calibration.get("method", {}).get("name"),
        "source": "export",
        "export": folder.resolve().name,
    }
    path = write_retention(out, retention.record(meta))
    print(f"\nretention of the export {folder} (lm-eval, zero-shot; {path})")
    print(retention.table())
    return path


def _check_target(out: Path, overwrite: bool) -> None:
    """Refuse to replace an existing retention.json unless asked to."""
    from calm_lightning.runtime.run_record import RETENTION_FILE

    target = out / RETENTION_FILE
    if target.exists() and not overwrite:
        raise ConfigError(
            f"{target} exists; pass overwrite=true to replace it, or another out=<dir>"
        )


def add_arguments(parser) -> None:
    parser.add_argument(
        "arguments",
        nargs="*",
        metavar="key=value",
        help="run_dir=<run dir or export folder> (required), tasks=[piqa,winogrande,...], "
        "data_files.<task>=[file,...], limit=N, batch_size=8, n_bins=10, out=<dir>, "
        "overwrite=false|true, trust_remote_code=false|true (false: the base model's Hub code "
        "never runs, whatever the run's config says); docs/retention.md",
    )


def command(args, parser) -> int:
    """Score the saved run (or export) the arguments name."""
    arguments = parse_arguments(args.arguments)
    evaluate_run(
        arguments.pop("run_dir"),
        arguments,
        out=arguments.pop("out", None),
        overwrite=arguments.pop("overwrite", False),
        trust_remote_code=arguments.pop("trust_remote_code", False),
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m calm_lightning.retention`: the same as `python -m calm_lightning retention`."""
    from calm_lightning.arguments import command_main

    return command_main("calm_lightning.retention", argv)


if __name__ == "__main__":
    raise SystemExit(main())
