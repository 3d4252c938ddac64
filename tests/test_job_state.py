"""A job's folder: its identity, one writer, finished jobs skipped, checkpoints found and
foreign ones refused, corrupt records named (runtime/job_state.py, runtime/checkpointing.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from calm_lightning.errors import ConfigError
from calm_lightning.run import finished_result
from calm_lightning.runtime import file_lock
from calm_lightning.runtime.checkpointing import STAMP_KEY, resolve_checkpoint
from calm_lightning.runtime.job_state import JobFolder, config_digest

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model=tiny", "method=calm", "logger=none"]


def test_the_digest_ignores_where_and_how_but_not_what(compose, tmp_path):
    a = config_digest(compose(JOB, tmp_path / "a"))
    assert a == config_digest(compose([*JOB, "logger=csv", "ckpt_path=null"], tmp_path / "b"))
    assert a == config_digest(compose([*JOB, "callbacks.periodic.every_n_train_steps=3"], tmp_path))
    assert a != config_digest(compose([*JOB, "method.module.upper_lr=0.5"], tmp_path / "a"))
    assert a != config_digest(compose([*JOB, "budget=full"], tmp_path / "a"))


def test_a_folder_of_another_job_is_refused_and_left_as_it_is(compose, tmp_path):
    JobFolder(compose(JOB, tmp_path)).acquire()
    before = (tmp_path / "job.json").read_text()
    other = JobFolder(compose([*JOB, "method.module.upper_lr=0.5"], tmp_path))
    with pytest.raises(ConfigError, match="holds another job .*new hydra.sweep.dir"):
        other.check_identity()
    assert (tmp_path / "job.json").read_text() == before


def _no_flock(handle, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # Lustre mounted with noflock


@pytest.mark.parametrize("locking", ["flock", "no flock"])
def test_one_writer_per_job_folder(compose, tmp_path, monkeypatch, locking):
    if locking == "no flock":  # the lease file must survive the start's cleanup of temporaries
        monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    first = JobFolder(compose(JOB, tmp_path))
    first.acquire()
    with pytest.raises(ConfigError, match="another process is running the job"):
        JobFolder(compose(JOB, tmp_path)).acquire()
    first.release()
    JobFolder(compose(JOB, tmp_path)).acquire()


def test_a_finished_job_is_read_back_and_a_corrupt_record_named(compose, tmp_path):
    cfg = compose(JOB, tmp_path)
    assert finished_result(cfg) is None  # no folder yet
    JobFolder(cfg).acquire()
    (tmp_path / "metrics.json").write_text(json.dumps({"metrics": {"accuracy": 0.5}}))
    assert finished_result(cfg)["metrics"] == {"accuracy": 0.5}
    (tmp_path / "metrics.json").write_text('{"metrics": ')
    with pytest.raises(ConfigError, match=r"metrics.json is corrupt .*move it out"):
        finished_result(cfg)
    assert (tmp_path / "metrics.json").read_text() == '{"metrics": '  # nothing deleted


def test_attempts_are_recorded_and_an_earlier_failure_is_kept_in_them(compose, tmp_path):
    job = JobFolder(compose(JOB, tmp_path))
    job.acquire()
    job.record_attempt(0, resumed=False)
    job.release()
    (tmp_path / "failed.json").write_text(json.dumps({"error": "RuntimeError: boom"}))
    (tmp_path / ".metrics.json.x1y2").write_text("half")  # a killed atomic write
    job.acquire()
    job.record_attempt(7, resumed=True)
    assert [(a["reason"], a["start_step"]) for a in job.attempts()] == [("fresh", 0), ("resume", 7)]
    assert job.attempts()[1]["previous_failure"] == "RuntimeError: boom"
    assert (
        not (tmp_path / "failed.json").exists() and not (tmp_path / ".metrics.json.x1y2").exists()
    )


def _checkpoint(path: Path, digest: str | None, step: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {"global_step": step, **({STAMP_KEY: {"digest": digest}} if digest else {})}
    torch.save(state, path)
    return path


def test_auto_takes_the_newest_checkpoint_of_this_job_that_loads(tmp_path):
    folder = tmp_path / "job"
    assert resolve_checkpoint("auto", folder, "mine") == (None, 0)
    _checkpoint(folder / "checkpoints" / "step-3.ckpt", "mine", 3)
    time.sleep(0.01)
    _checkpoint(folder / "checkpoints" / "other.ckpt", "theirs", 9)
    time.sleep(0.01)
    (folder / "checkpoints" / "step-5.ckpt").write_bytes(b"cut short")
    assert resolve_checkpoint("auto", folder, "mine") == (
        str(folder / "checkpoints/step-3.ckpt"),
        3,
    )
    assert resolve_checkpoint(None, folder, "mine") == (None, 0)


def test_an_explicit_checkpoint_of_another_config_or_no_checkpoint_is_refused(tmp_path):
    foreign = _checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", "theirs", 4)
    with pytest.raises(ConfigError, match="written by another configuration .*drop ckpt_path"):
        resolve_checkpoint(str(foreign), tmp_path / "job", "mine")
    with pytest.raises(ConfigError, match="written by another configuration"):
        resolve_checkpoint(str(tmp_path / "run"), tmp_path / "job", "mine")  # a run folder
    with pytest.raises(ConfigError, match="no checkpoint at"):
        resolve_checkpoint(str(tmp_path / "nowhere.ckpt"), tmp_path / "job", "mine")
    (tmp_path / "bad.ckpt").write_text("not a checkpoint")
    with pytest.raises(ConfigError, match="does not load as a checkpoint .*drop ckpt_path"):
        resolve_checkpoint(str(tmp_path / "bad.ckpt"), tmp_path / "job", "mine")


@pytest.mark.integration  # the command line, in a subprocess
def test_a_relaunch_into_another_grids_folder_is_a_one_line_error(tmp_path):
    sweep = tmp_path / "sweep"
    job = sweep / "0_tiny_calm_demo_id"
    job.mkdir(parents=True)
    (job / "job.json").write_text(json.dumps({"digest": "0123456789abcdef"}))
    cmd = [sys.executable, "-m", "calm_lightning.run", "-m", *JOB, f"hydra.sweep.dir={sweep}"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1
    assert "holds another job (config digest 0123456789abcdef" in done.stderr
    assert "Traceback" not in done.stderr
    # Hydra's own files (.hydra/, run.log) aside, the folder is as it was
    assert {p.name for p in job.iterdir()} - {".hydra", "run.log"} == {"job.json"}
