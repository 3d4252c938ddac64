"""Language-ability retention: lm-eval-harness tasks (HellaSwag, ARC, WinoGrande, PIQA, ...)
zero-shot on the base model and on the calibrated one, with lm-eval's own task definitions,
prompts, metrics and evaluation loop (docs/retention.md).

What is ours: the model adapter (`lm_eval_model.CalibratedHFLM`), the tasks' settings and
their local files with clear errors when a task's data cannot be had (lm_eval_tasks.py), and,
per task, the calibration of the option distribution lm-eval scored (softmax over the choices'
log-likelihoods) with the project's own conf-ECE.

lm_eval is imported inside the functions: `import calm_lightning` and runs without retention
never pay for it.
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from calm_lightning.evaluation.lm_eval_tasks import RetentionSettings, load_tasks
from calm_lightning.metrics.calibration import confidence_ece
from calm_lightning.runtime.run_record import RETENTION_DIR

log = logging.getLogger(__name__)

# lm-eval's own default seed for few-shot sampling (zero-shot here, but set as lm-eval does).
FEWSHOT_SEED = 1234


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
        # By name and content hash: the record is shared, the machine's folders are not.
        "data_files": {k: [_public_file(f) for f in v] for k, v in settings.data_files.items()},
        "rows": rows,
    }


def _public_file(path: str) -> dict:
    """A local data file as a shareable record names it: its name and its bytes' sha256."""
    from calm_lightning.evaluation.base_cache import file_digest

    return {"name": Path(path).name, "sha256": file_digest(path)}


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
