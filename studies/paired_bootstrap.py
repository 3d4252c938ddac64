"""Is one run's conf-ECE really lower than another's on the same questions?

The study's test split has 320 questions and its held-out split 160; a conf-ECE estimated on so
few is noisy, and two runs scored on the same questions share most of that noise. This script
reads two runs' `predictions.jsonl`, pairs the questions by id and reports each run's
conf-ECE, their difference (b − a) and the paired bootstrap's standard error and 95 %
percentile interval of that difference (the same resampled questions for both runs), with the
package's vectorised bootstrap (calm_lightning/metrics/bootstrap.py, which the report uses).

    python studies/paired_bootstrap.py RUN_A RUN_B [--metric conf_ece|classwise_ece|nll|accuracy]
        [--resamples 2000] [--seed 0]

RUN_A and RUN_B are run folders (or their predictions files).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def predictions(path: Path) -> dict[str, tuple[list[float], int]]:
    """Question id -> (option probabilities, label) of one run folder."""
    from calm_lightning.runtime.run_record import PREDICTIONS_FILE, read_predictions

    if path.is_file() and path.name == PREDICTIONS_FILE:
        path = path.parent
    if not (path / PREDICTIONS_FILE).is_file():
        sys.exit(f"error: no {PREDICTIONS_FILE} in {path}: give a run folder that was scored")
    return {r["id"]: (r["probs"], int(r["label"])) for r in read_predictions(path)}


def paired(a: dict, b: dict):
    """The two runs' probabilities and the labels on the questions both scored, in one order."""
    import numpy as np

    ids = sorted(a.keys() & b.keys())
    if not ids:
        sys.exit("error: the two runs share no question id; were they scored on the same split?")
    if any(a[i][1] != b[i][1] for i in ids):
        sys.exit("error: the two runs label a shared question differently")
    return (np.array([a[i][0] for i in ids]), np.array([b[i][0] for i in ids]),
            np.array([a[i][1] for i in ids]))  # fmt: skip


# The script's metric names -> the package's keys (metrics.json's).
METRICS = {"conf_ece": "conf_ece", "classwise_ece": "cw_ece", "nll": "nll", "accuracy": "accuracy"}


def compare(pa, pb, labels, metric: str = "conf_ece", resamples: int = 2000, seed: int = 0) -> dict:
    """The metric of each run, the difference b − a, and the paired bootstrap of it (the
    package's, calm_lightning/metrics/bootstrap.py: the report uses the same)."""
    from calm_lightning.metrics.bootstrap import (
        BootstrapSettings,
        ScoredQuestions,
        paired_differences,
    )

    key = METRICS[metric]
    # Resampling question indices: both runs see the same questions each time.
    pair = (ScoredQuestions.from_probs(pa, labels), ScoredQuestions.from_probs(pb, labels))
    out = paired_differences([pair], (key,), BootstrapSettings(resamples, seed, 0))[key]
    return {"metric": metric, "questions": out.questions, "a": out.a, "b": out.b,
            "difference": out.difference, "standard_error": out.standard_error,
            "ci95": [float(x) for x in out.ci95]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--metric", choices=list(METRICS), default="conf_ece")
    parser.add_argument("--resamples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = compare(*paired(predictions(args.run_a), predictions(args.run_b)),
                  metric=args.metric, resamples=args.resamples, seed=args.seed)  # fmt: skip
    print(f"{out['metric']} on {out['questions']} shared questions")
    print(f"  a  {out['a']:.4f}  ({args.run_a})")
    print(f"  b  {out['b']:.4f}  ({args.run_b})")
    low, high = out["ci95"]
    print(f"  b - a  {out['difference']:+.4f}  paired bootstrap s.e. {out['standard_error']:.4f}, "
          f"95 % interval [{low:+.4f}, {high:+.4f}] ({args.resamples} resamples)")  # fmt: skip


if __name__ == "__main__":
    main()
