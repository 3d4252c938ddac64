"""W&B offline: the run files hold the metrics, the flattened config, the reliability image and
the predictions table; the run id is kept in the output dir for resumes."""

from __future__ import annotations

import json
import struct

import pytest

from calm_lightning.pipeline import run_experiment

pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

BLOCK, HEADER = 32768, 7


def read_wandb_records(path) -> list:
    """Records of a .wandb file (W&B's LevelDB-style log: 32 KiB blocks, 7-byte record
    headers of crc32 / length / type), written here because wandb no longer ships a reader."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    records, pending, pos = [], b"", HEADER
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer too short for a header: padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending = (b"" if kind == 2 else pending) + chunk
        elif kind == 4:
            records.append(pending + chunk)
    parsed = []
    for raw in records:
        record = pb.Record()
        record.ParseFromString(raw)
        parsed.append(record)
    return parsed


def _values(records, kind: str) -> dict:
    out = {}
    for record in records:
        if record.WhichOneof("record_type") != kind:
            continue
        items = {
            "summary": lambda r: r.summary.update,
            "history": lambda r: r.history.item,
            "config": lambda r: r.config.update,
        }[kind](record)
        for item in items:
            key = item.key or "/".join(item.nested_key)
            out[key] = json.loads(item.value_json)
    return out


@pytest.mark.integration
def test_offline_wandb_run_holds_metrics_config_image_and_table(tmp_path, monkeypatch, compose):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose(
        [
            "model=tiny",
            "method=base",
            "setting.test.limit=8",
            "logger=wandb",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    metrics = run_experiment(cfg).metrics
    (run_file,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    run_id = (tmp_path / "wandb_id.txt").read_text().strip()
    assert run_file.name == f"run-{run_id}.wandb"
    records = read_wandb_records(run_file)
    summary = _values(records, "summary")
    history = _values(records, "history")
    assert summary["base/conf_ece"] == pytest.approx(metrics["conf_ece"])
    # the ranking metrics and the intervals reach the summary too (nested, as in metrics.json)
    assert summary["base/aurc"] == pytest.approx(metrics["aurc"])
    assert summary["base/ci95"]["conf_ece"] == pytest.approx(metrics["ci95"]["conf_ece"])
    assert history["test/accuracy"] == pytest.approx(metrics["accuracy"])
    config = _values(records, "config")
    # Nested, as W&B shows it (`model.name`) and as its saved views address it.
    assert config["model"]["name"] == "tiny" and config["seed"] == 0
    # Its public part only: nothing that says where the job's files are (W&B is shared).
    assert not {"paths", "hydra", "logger", "callbacks", "ckpt_path"} & set(config)
    ours = {k: v for k, v in config.items() if not k.startswith("_")}
    assert str(tmp_path) not in json.dumps(ours) and "default_root_dir" not in ours["trainer"]
    media = run_file.parent / "files" / "media"
    assert list(media.glob("images/reliability_*.png"))
    (table,) = list(media.glob("table/predictions_*.table.json"))
    assert len(json.loads(table.read_text())["data"]) == 8


@pytest.mark.integration
def test_open_qa_run_publishes_sem_ece_and_the_question_table(
    tmp_path, monkeypatch, compose, gen_ood
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = compose(gen_ood("method=base", "clusterer=exact", "logger=wandb"), tmp_path)
    metrics = run_experiment(cfg).metrics
    (run_file,) = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    summary = _values(read_wandb_records(run_file), "summary")
    assert summary["base/sem_ece"] == pytest.approx(metrics["sem_ece"])
    (table,) = list((run_file.parent / "files" / "media").glob("table/predictions_*.table.json"))
    content = json.loads(table.read_text())
    assert {"samples", "clusters", "answer", "confidence", "correct"} <= set(content["columns"])
    rows = [json.loads(line) for line in (tmp_path / "predictions.jsonl").read_text().splitlines()]
    samples = content["columns"].index("samples")
    assert [json.loads(r[samples]) for r in content["data"]] == [r["samples"] for r in rows]


def test_a_relaunched_job_continues_its_wandb_run(tmp_path, compose):
    """A job started again in its folder (killed, requeued) logs to the W&B run it began,
    resumed with resume="allow", never to a second run."""
    from calm_lightning.runtime.loggers import build_loggers

    cfg = compose(["model=tiny", "logger=wandb", "logger.wandb.offline=true"], tmp_path)
    (first,) = build_loggers(cfg)
    (again,) = build_loggers(cfg)  # the next attempt, before any checkpoint
    run_id = (tmp_path / "wandb_id.txt").read_text()
    assert first._wandb_init["id"] == again._wandb_init["id"] == run_id
    assert again._wandb_init["resume"] == "allow"
