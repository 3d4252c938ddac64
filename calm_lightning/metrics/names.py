"""The one list of reported metrics: key (as in metrics.json), label, which way is better,
and where each appears. The run's printed table, the model card, the report's tables and its
csv files all read it; the metric functions themselves are in calibration.py / semantic.py."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    key: str
    label: str  # column label in the run's table and the model card
    better: str | None = "lower"  # lower | higher | None (descriptive, e.g. mean confidence)
    percent: bool = False  # shown as a percentage
    run_table: bool = True  # in the table a run prints (and the model card)
    report: bool = True  # in the report's tables and selected.csv
    results_csv: bool = True  # in the report's results.csv (one row per run)
    report_label: str | None = None  # the report's column label, when not `label`

    @property
    def column(self) -> str:
        return self.report_label or self.label


METRICS = (
    Metric("accuracy", "acc", "higher", percent=True, report_label="Acc."),
    # cloze scoring: lm-eval's length-normalised accuracy
    Metric("acc_norm", "acc_norm", "higher", percent=True, report=False, results_csv=False),
    Metric("sem_ece", "Sem-ECE"),  # open-ended QA
    Metric("mean_confidence", "mean conf", None, report=False, results_csv=False),
    Metric("unattempted", "no answer", None, percent=True, report=False, results_csv=False),
    Metric("conf_ece", "conf-ECE"),
    Metric("cw_ece", "cw-ECE"),
    Metric("mce", "MCE"),
    Metric("ace", "ACE"),  # adaptive calibration error (equal-mass ranges)
    Metric("avg_ce", "AvgCE", run_table=False),  # netcal's average calibration error
    Metric("brier", "Brier"),
    Metric("nll", "NLL", report=False),
    # beside conf-ECE: equal-mass ranges, Kumar et al.'s debiased l2 error, relplot's smooth ECE
    Metric("ece_em", "EM-ECE", run_table=False, report=False),
    Metric("rmsce_debiased", "dRMSCE", run_table=False, report=False),
    Metric("smece", "smECE", run_table=False, report=False),
    # ranking: confidence against correctness, untouched by a temperature (metrics/ranking.py)
    Metric("auroc", "AUROC", "higher"),
    Metric("aurc", "AURC", run_table=False),
    Metric("sel_acc_80", "acc@80%", "higher", percent=True, run_table=False, report=False),
)
BY_KEY = {m.key: m for m in METRICS}
PERCENT = tuple(m.key for m in METRICS if m.percent)


def run_table_columns(rows: dict[str, dict]) -> list[tuple[str, str]]:
    """(key, label) of the run-table metrics some row reports (MCQA and open-ended QA report
    different ones); rows: name -> metrics dict."""
    return [
        (m.key, m.label)
        for m in METRICS
        if m.run_table and any(m.key in metrics for metrics in rows.values())
    ]


def report_metrics() -> tuple[Metric, ...]:
    """The report's columns: the calibration errors first, accuracy last."""
    chosen = [m for m in METRICS if m.report]
    return tuple(sorted(chosen, key=lambda m: m.key == "accuracy"))


def results_csv_keys() -> tuple[str, ...]:
    return tuple(m.key for m in METRICS if m.results_csv)
