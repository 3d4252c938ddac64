"""An MCQA evaluation as a run record (runtime/run_record.py writes it), its reliability
diagram, and the table printed at the end of a run."""

from __future__ import annotations

from pathlib import Path

from calm_lightning.metrics.names import PERCENT, run_table_columns
from calm_lightning.metrics.reliability import plot_reliability_diagram
from calm_lightning.runtime.run_record import Evaluation


def run_meta(cfg) -> dict:
    """Which run a result file belongs to: model, method, setting, seed."""
    return {
        "model": cfg.model.name,
        "model_id": cfg.model.get("model_id"),
        "method": cfg.method.name,
        "setting": cfg.setting.name,
        "seed": cfg.seed,
    }


def mcqa_evaluation(predictions, metrics: dict, meta: dict) -> Evaluation:
    """The run record of an MCQA evaluation: metrics.json's payload and one predictions row
    per question (option probabilities, stated answer, confidence, correctness)."""
    summary = {
        "metrics": metrics,
        **meta,
        "option_tokens": {
            "style": predictions.option_tokens.style,
            "ids": list(predictions.option_tokens.ids),
            "letters": predictions.option_tokens.letters,
        },
    }
    letters = predictions.option_tokens.letters
    stated = predictions.predicted
    if stated is None:
        stated = predictions.probs.argmax(1)
    rows = []
    for example_id, probs, label, prediction in zip(
        predictions.ids, predictions.probs, predictions.labels, stated, strict=True
    ):
        prediction = int(prediction)
        rows.append(
            {
                "id": example_id,
                # 6 significant digits, not decimals: a paired NLL read back from this file
                # needs the gold option's probability when it is tiny (1e-12 is not 0).
                "probs": [float(f"{float(p):.6g}") for p in probs],
                "label": int(label),
                "prediction": prediction,
                "predicted_letter": letters[prediction],
                "confidence": float(f"{float(probs[prediction]):.6g}"),
                "correct": prediction == int(label),
            }
        )
    return Evaluation(summary, rows)


def plot_mcqa_reliability(predictions, path: Path, title: str = "") -> None:
    plot_reliability_diagram(
        predictions.probs,
        predictions.labels,
        path,
        title=title,
        predictions=predictions.predicted,
    )


def format_table(rows: dict[str, dict]) -> str:
    """A fixed-width table, one row per method (name -> metrics dict); a column appears when
    some row has that metric (MCQA and open-ended QA report different ones)."""
    columns = run_table_columns(rows)
    width = max([len("method")] + [len(name) for name in rows])
    header = "method".ljust(width) + "".join(f"{label:>10}" for _, label in columns)
    lines = [header, "-" * len(header)]
    for name, metrics in rows.items():
        cells = []
        for key, _ in columns:
            value = metrics.get(key)
            if value is None:
                cells.append(f"{'-':>10}")
            elif key in PERCENT:
                cells.append(f"{100 * value:>9.2f}%")
            else:
                cells.append(f"{value:>10.4f}")
        lines.append(name.ljust(width) + "".join(cells))
    return "\n".join(lines)
