"""The run record owns the run directory: its file names, the one write and the one reader."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from calm_lightning.runtime import run_record
from calm_lightning.runtime.run_record import (
    Evaluation,
    RunRecordError,
    RunResult,
    find_runs,
    read_run,
    write_config,
    write_failure,
    write_predictions,
    write_retention,
    write_row,
    write_run,
)

ROOT = Path(__file__).resolve().parents[1]


def test_file_names_live_in_the_run_record_only():
    names = [
        getattr(run_record, n)
        for n in dir(run_record)
        if n.endswith(("_FILE", "_DIR", "_CHECKPOINT")) and isinstance(getattr(run_record, n), str)
    ]
    assert {"metrics.json", "predictions.jsonl", "config_resolved.yaml", "failed.json"} <= set(
        names
    )
    folders = ("calm_lightning", "benchmarks", "studies")
    sources = [path for folder in folders for path in (ROOT / folder).rglob("*.py")]
    for path in sources:
        if path.name == "run_record.py":
            continue
        text = path.read_text()
        for literal in ('"metrics.json"', '"predictions.jsonl"', '"config_resolved.yaml"'):
            assert literal not in text, f"{path.relative_to(ROOT)} spells {literal}"


def test_the_run_record_is_low_level():
    tree = ast.parse((ROOT / "calm_lightning" / "runtime" / "run_record.py").read_text())
    imported = {
        node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    } | {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    ours = {m for m in imported if m.startswith("calm_lightning")}
    assert ours <= {"calm_lightning.errors"}, ours


def test_the_writer_never_reads_back_what_it_wrote():
    pipeline = (ROOT / "calm_lightning" / "pipeline.py").read_text()
    assert len(pipeline.splitlines()) <= 220
    for module in ("pipeline.py", "runtime/loggers.py"):
        text = (ROOT / "calm_lightning" / module).read_text()
        assert not re.search(r"read_text|json\.load|read_run|open\(", text), module


def _evaluation(n: int = 3) -> Evaluation:
    rows = [{"id": f"q{i}", "confidence": 0.5 + 0.1 * i, "correct": i % 2 == 0} for i in range(n)]
    return Evaluation({"metrics": {"accuracy": 2 / 3, "n": n}, "method": "calm"}, rows)


def test_write_then_read_a_finished_run(tmp_path):
    root, tmp_path = tmp_path, tmp_path / "runs" / "one"
    cfg = OmegaConf.create({"model": {"name": "tiny"}, "method": {"name": "calm"}, "seed": 3})
    write_config(tmp_path, cfg)
    evaluation = _evaluation()
    write_predictions(tmp_path, evaluation)
    base = Evaluation({"metrics": {"accuracy": 0.5, "n": 3}, "method": "base"}, [{"id": "q0"}])
    write_row(tmp_path / run_record.BASE_DIR, base)
    comparison = {"base": base.metrics, "calm": evaluation.metrics}
    result = RunResult(tmp_path, evaluation, comparison, {"timings": {"fit_s": 1.0}}, {"n": 3})
    assert read_run(tmp_path).error.startswith("no metrics.json")  # not finished yet
    write_run(result)
    write_retention(tmp_path, {"rows": {"base": {"piqa": {"acc": 0.6}}}})

    record = read_run(tmp_path)
    assert record.finished and record.error is None
    assert record.metrics == evaluation.metrics
    assert record.comparison == comparison
    assert record.summary["timings"] == {"fit_s": 1.0} and record.summary["method"] == "calm"
    assert record.get("method.name") == "calm" and record.get("seed") == 3
    assert record.predictions() == evaluation.rows
    assert record.predictions("base") == base.rows
    assert record.data_summary == {"n": 3}
    assert record.retention["rows"]["base"]["piqa"]["acc"] == 0.6
    # Plain JSON, as any tool reads it; no temporary file left behind by the atomic writes.
    on_disk = json.loads((tmp_path / run_record.METRICS_FILE).read_text())
    assert on_disk == result.summary()
    assert not [p for p in tmp_path.rglob(".*") if p.is_file()]
    # as readable as any file the run writes (the temporary file of mkstemp is private)
    umask = os.umask(0)
    os.umask(umask)
    mode = (tmp_path / run_record.METRICS_FILE).stat().st_mode & 0o777
    assert mode == 0o666 & ~umask
    assert [r.path for r in find_runs([root])] == [tmp_path]


def test_a_failed_job_and_a_folder_that_is_no_run(tmp_path):
    write_config(tmp_path / "job", OmegaConf.create({"method": {"name": "reg"}}))
    try:
        raise ValueError("bad head")
    except ValueError as err:
        write_failure(tmp_path / "job", err)
    record = read_run(tmp_path / "job")
    assert not record.finished and record.error == "ValueError: bad head"
    assert "Traceback" in record.failure["traceback"]
    with pytest.raises(RunRecordError, match="not a run directory"):
        read_run(tmp_path)
    with pytest.raises(RunRecordError, match="no such run directory"):
        read_run(tmp_path / "missing")
    with pytest.raises(RunRecordError, match="has no predictions.jsonl"):
        record.predictions()
