"""Under the parallel launcher each job runs in a process of its own (runtime/job_process.py):
it sees the job's config and Hydra state as the worker does, what it returns or raises reaches
the worker, and when it dies without an answer the worker records the job as failed and goes
on. The whole sweep: tests/test_chaos.py (integration)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict, read_write

from calm_lightning.runtime import job_process
from calm_lightning.runtime.file_lock import FileLock
from calm_lightning.runtime.run_record import FAILED_FILE, METRICS_FILE

HERE = "tests.test_job_process"  # light on purpose (no torch): each job process imports it


# ----- the tasks the job process runs (found by name, as run.py's run_job is) -----
def reports_its_job(cfg) -> dict:
    from calm_lightning.runtime.parallel import under_joblib

    hydra = HydraConfig.get()
    return {
        "pid": os.getpid(),
        "seed": cfg.seed,
        "output_dir": cfg.paths.output_dir,
        "job_num": hydra.job.num,
        "sweep_dir": hydra.sweep.dir,
        "under_joblib": under_joblib(),
    }


def raises_value_error(cfg):
    raise ValueError("a bad value")


def exits_3(cfg):
    raise SystemExit(3)


def is_killed(cfg):
    os.kill(os.getpid(), signal.SIGKILL)


def sleeps(cfg):
    (Path(cfg.paths.output_dir) / "pid").write_text(str(os.getpid()))
    time.sleep(60)


@pytest.fixture
def in_job(compose, tmp_path):
    """The config of job 3 of a parallel sweep, with Hydra's state set as the launcher sets it
    in the worker before the task function runs."""
    out = tmp_path / "sweep" / "3_job"
    out.mkdir(parents=True)
    cfg = compose(
        ["hydra/launcher=parallel", "hydra.mode=MULTIRUN", "seed=7", "model=tiny",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        out, hydra=True,
    )  # fmt: skip
    with read_write(cfg.hydra):
        cfg.hydra.job.num = 3
        cfg.hydra.job.name = "run"
        cfg.hydra.runtime.output_dir = str(out)
    HydraConfig.instance().set_config(cfg)
    task = cfg.copy()
    with open_dict(task):
        del task["hydra"]  # a job's config holds no hydra node (HydraConfig has it)
    yield task
    HydraConfig.instance().cfg = None


def test_the_job_process_sees_the_job_as_the_worker_does(in_job, tmp_path):
    got = job_process.run_in_own_process(f"{HERE}:reports_its_job", in_job)
    assert got["pid"] != os.getpid()
    assert got == {
        **got,
        "seed": 7,
        "output_dir": str(tmp_path / "sweep" / "3_job"),
        "job_num": 3,
        "sweep_dir": str(tmp_path / "sweep"),
        "under_joblib": True,  # the GPU pool's size and the base cache follow the launcher
    }
    assert (tmp_path / "sweep" / "3_job" / "run.log").is_file()  # Hydra's job log, as in the worker


def test_what_the_job_raises_is_raised_in_the_worker(in_job):
    with pytest.raises(ValueError, match="a bad value"):
        job_process.run_in_own_process(f"{HERE}:raises_value_error", in_job)
    with pytest.raises(SystemExit) as stopped:  # the identity refusal stops the sweep as before
        job_process.run_in_own_process(f"{HERE}:exits_3", in_job)
    assert stopped.value.code == 3


def test_a_killed_job_is_recorded_as_failed_and_the_worker_goes_on(in_job):
    out = Path(in_job.paths.output_dir)
    assert job_process.run_in_own_process(f"{HERE}:is_killed", in_job) is None
    record = json.loads((out / FAILED_FILE).read_text())
    assert record["error"].startswith("JobProcessDied: the job's process was killed by SIGKILL")
    assert "relaunch the same command" in record["error"]
    # the worker is fine: the next job runs
    assert job_process.run_in_own_process(f"{HERE}:reports_its_job", in_job)["seed"] == 7


def test_a_job_killed_after_it_finished_or_run_by_another_process_is_not_marked_failed(tmp_path):
    finished = tmp_path / "finished"
    finished.mkdir()
    (finished / METRICS_FILE).write_text("{}")
    job_process.record_lost_job(finished, -signal.SIGKILL)
    assert not (finished / FAILED_FILE).exists()

    taken = tmp_path / "taken"
    lock = FileLock(taken / ".job.lock")
    assert lock.acquire(blocking=False)
    try:
        job_process.record_lost_job(taken, -signal.SIGKILL)  # a relaunch runs it already
        assert not (taken / FAILED_FILE).exists()
    finally:
        lock.release()
    job_process.record_lost_job(taken, 4)
    error = json.loads((taken / FAILED_FILE).read_text())["error"]
    assert "exited with status 4 without a result" in error


def _worker(task_cfg) -> None:
    job_process.run_in_own_process(f"{HERE}:sleeps", task_cfg)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_job_process_does_not_outlive_its_worker(in_job, monkeypatch, tmp_path):
    """A worker that dies (the sweep is stopping) takes its job with it: no job runs on
    unsupervised, holding its folder's lock and its GPU, and the job process removes the
    files the worker handed it the job through."""
    exchange = tmp_path / "tmp"
    exchange.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(exchange))  # the forked worker's too
    pid_file = Path(in_job.paths.output_dir) / "pid"
    worker = multiprocessing.get_context("fork").Process(target=_worker, args=(in_job,))
    worker.start()
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the job process did not start"
        time.sleep(0.1)
    job = int(pid_file.read_text())
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    deadline = time.monotonic() + 10 * job_process.PARENT_POLL_S
    while _alive(job):
        assert time.monotonic() < deadline, "the job process outlived its worker"
        time.sleep(0.1)
    assert not list(exchange.iterdir())
