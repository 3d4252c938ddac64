"""Result files every run writes (metrics.json, predictions.jsonl, reliability.png) and the
table printed at the end of a run."""

from __future__ import annotations

import json
from pathlib import Path

from calm_lightning.metrics.reliability import plot_reliability_diagram

TABLE_COLUMNS = (
    ("accuracy", "acc"),
    ("acc_norm", "acc_norm"),  # cloze scoring: lm-eval's length-normalised accuracy
    ("sem_ece", "Sem-ECE"),
    ("mean_confidence", "mean conf"),
    ("unattempted", "no answer"),
    ("conf_ece", "conf-ECE"),
    ("cw_ece", "cw-ECE"),
    ("mce", "MCE"),
    ("ace", "ACE"),
    ("brier", "Brier"),
    ("nll", "NLL"),
)


def run_meta(cfg) -> dict:
    """Which run a result file belongs to: model, method, setting, seed."""
    return {
        "model": cfg.model.name,
        "model_id": cfg.model.get("model_id"),
        "method": cfg.method.name,
        "setting": cfg.setting.name,
        "seed": cfg.seed,
    }


def result_paths(directory: str | Path) -> dict[str, Path]:
    """The result files every run writes under `directory` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "metrics": directory / "metrics.json",
        "predictions": directory / "predictions.jsonl",
        "reliability": directory / "reliability.png",
    }


def write_mcqa_results(
    directory: str | Path, predictions, metrics: dict, meta: dict, title: str = ""
) -> dict[str, Path]:
    """Write metrics, per-example predictions and the reliability diagram under `directory`."""
    paths = result_paths(directory)
    payload = {
        "metrics": metrics,
        **meta,
        "option_tokens": {
            "style": predictions.option_tokens.style,
            "ids": list(predictions.option_tokens.ids),
            "letters": predictions.option_tokens.letters,
        },
    }
    paths["metrics"].write_text(json.dumps(payload, indent=2))
    letters = predictions.option_tokens.letters
    with paths["predictions"].open("w", encoding="utf-8") as handle:
        stated = predictions.predicted
        if stated is None:
            stated = predictions.probs.argmax(1)
        for example_id, probs, label, prediction in zip(
            predictions.ids, predictions.probs, predictions.labels, stated, strict=True
        ):
            prediction = int(prediction)
            row = {
                "id": example_id,
                "probs": [round(float(p), 6) for p in probs],
                "label": int(label),
                "prediction": prediction,
                "predicted_letter": letters[prediction],
                "confidence": round(float(probs[prediction]), 6),
                "correct": prediction == int(label),
            }
            handle.write(json.dumps(row) + "\n")
    plot_reliability_diagram(
        predictions.probs,
        predictions.labels,
        paths["reliability"],
        title=title,
        predictions=predictions.predicted,
    )
    return paths


def format_table(rows: dict[str, dict]) -> str:
    """A fixed-width table, one row per method (name -> metrics dict); a column appears when
    some row has that metric (MCQA and open-ended QA report different ones)."""
    columns = [(k, label) for k, label in TABLE_COLUMNS if any(k in m for m in rows.values())]
    width = max([len("method")] + [len(name) for name in rows])
    header = "method".ljust(width) + "".join(f"{label:>10}" for _, label in columns)
    lines = [header, "-" * len(header)]
    for name, metrics in rows.items():
        cells = []
        for key, _ in columns:
            value = metrics.get(key)
            if value is None:
                cells.append(f"{'-':>10}")
            elif key in ("accuracy", "acc_norm", "unattempted"):
                cells.append(f"{100 * value:>9.2f}%")
            else:
                cells.append(f"{value:>10.4f}")
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)
