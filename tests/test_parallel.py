"""Parallel local sweeps (hydra/launcher=parallel, Hydra's joblib launcher): one device per
job, impossible combinations refused before the model loads, the base cache shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hydra.core.hydra_config import HydraConfig

from calm_lightning.errors import ConfigError
from calm_lightning.runtime import parallel
from calm_lightning.runtime.run_record import BASE_DIR, METRICS_FILE

pytest.importorskip("hydra_plugins.hydra_joblib_launcher")

TINY = ["model=tiny", "method=calm", "peft.r=4", "setting=demo", "logger=none"]


@pytest.fixture
def in_job(compose, tmp_path):
    """`in_job(overrides)`: the composed config, with Hydra's state set as inside a job of a
    multirun (what the launcher does before a job runs)."""

    def enter(overrides, job_num=0):
        cfg = compose([*TINY, "hydra.mode=MULTIRUN", *overrides], tmp_path, hydra=True)
        cfg.hydra.job.num = job_num
        HydraConfig.instance().set_config(cfg)
        return cfg

    yield enter
    HydraConfig.instance().cfg = None


def test_parallel_ddp_jobs_are_refused_naming_what_to_do(in_job):
    cfg = in_job(["hydra/launcher=parallel", "hydra.launcher.n_jobs=3", "trainer=ddp"])
    assert parallel.parallel_jobs() == 3
    with pytest.raises(ConfigError, match="trainer=parallel_job") as err:
        parallel.check_parallel_jobs(cfg)
    assert "3 jobs at once" in str(err.value) and "2 devices" in str(err.value)


def test_several_devices_per_job_are_refused_without_ddp(in_job):
    cfg = in_job(["hydra/launcher=parallel", "trainer.devices=[0,1]"])
    with pytest.raises(ConfigError, match="asks for 2 devices"):
        parallel.check_parallel_jobs(cfg)


def test_one_device_per_job_and_the_basic_launcher_pass(in_job):
    parallel.check_parallel_jobs(in_job(["hydra/launcher=parallel", "trainer=parallel_job"]))
    # The basic launcher runs one job at a time: the multi-process checks of a run apply.
    assert parallel.parallel_jobs() > 1
    cfg = in_job(["trainer=ddp"])
    assert parallel.parallel_jobs() == 1
    parallel.check_parallel_jobs(cfg)


def test_job_k_runs_on_gpu_k_mod_the_gpus(in_job, monkeypatch):
    in_job(["hydra/launcher=parallel", "trainer=parallel_job"], job_num=5)
    monkeypatch.setattr(parallel, "_gpu_count", lambda: 4)
    assert parallel.job_devices() == [1]
    monkeypatch.setattr(parallel, "_gpu_count", lambda: 0)
    assert parallel.job_devices() == 1


def test_the_refusal_comes_before_the_model_loads(in_job, monkeypatch):
    from omegaconf import open_dict

    from calm_lightning import pipeline

    cfg = in_job(["hydra/launcher=parallel", "trainer=ddp"]).copy()
    with open_dict(cfg):
        del cfg["hydra"]  # a job's config holds no hydra node (HydraConfig has it)

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(pipeline, "load_language_model", no_model)
    with pytest.raises(ConfigError, match="trainer=parallel_job"):
        pipeline.run_experiment(cfg)


@pytest.mark.slow
def test_parallel_sweep_scores_the_base_once(tmp_path):
    """Three jobs at once through joblib: one computes the base row, two wait and read it."""
    sweep = tmp_path / "sweep"
    args = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        "--multirun",
        "hydra/launcher=parallel",
        "hydra.launcher.n_jobs=3",
        "trainer=parallel_job",
        *TINY,
        "setting.test.limit=8",
        "trainer.limit_train_batches=1",
        "method.module.inner_steps=1",
        "trainer.enable_progress_bar=false",
        "method.module.upper_lr=0.01,0.05,0.1",
        f"hydra.sweep.dir={sweep}",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if (p / METRICS_FILE).is_file())
    assert len(jobs) == 3
    cached = [json.loads((j / METRICS_FILE).read_text())["base_cache"]["base"] for j in jobs]
    assert sorted(c["status"] for c in cached) == ["computed", "read", "read"]
    assert len({c["fingerprint"] for c in cached}) == 1
    base = [{p.name: p.read_bytes() for p in (j / BASE_DIR).iterdir()} for j in jobs]
    assert base[0] == base[1] == base[2]
