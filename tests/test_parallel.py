"""Parallel local sweeps (hydra/launcher=parallel, Hydra's joblib launcher): one device per
job, impossible combinations refused before the model loads, the base cache shared."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hydra.core.hydra_config import HydraConfig

from calm_lightning.errors import ConfigError
from calm_lightning.runtime import parallel
from calm_lightning.runtime.device_pool import DevicePool
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
    parallel.release_job_device()  # a GPU a test's job took from its pool
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


def test_one_device_per_job_and_the_basic_launcher_pass(in_job, monkeypatch, tmp_path):
    monkeypatch.setattr(parallel, "_gpu_count", lambda: 2)  # the same on any machine
    jobs = ["hydra/launcher=parallel", "trainer=parallel_job", f"hydra.sweep.dir={tmp_path}"]
    parallel.check_parallel_jobs(in_job(jobs))
    # The basic launcher runs one job at a time: the multi-process checks of a run apply.
    assert parallel.parallel_jobs() > 1
    cfg = in_job(["trainer=ddp"])
    assert parallel.parallel_jobs() == 1
    parallel.check_parallel_jobs(cfg)


def _as_job(cfg, job_num: int) -> None:
    """Hydra's state as inside job `job_num` of the sweep `cfg` belongs to."""
    from omegaconf import read_write

    with read_write(cfg.hydra):  # set_config made it read-only
        cfg.hydra.job.num = job_num
    HydraConfig.instance().set_config(cfg)


def _other_job(cfg, job_num: int, taken, leave) -> None:
    """A concurrent job in its own process: takes its GPU, reports it, holds it until told."""
    _as_job(cfg, job_num)
    taken.put(parallel.job_devices()[0])
    leave.wait(30)
    parallel.release_job_device()


def test_each_job_takes_a_free_gpu_and_a_freed_one_is_reused(in_job, monkeypatch, tmp_path):
    # Two GPUs emulated on the CPU; joblib's order of jobs is arbitrary, so jobs 2 and 0 run
    # together (k mod 2 would put both on GPU 0) and job 4 starts when job 0 ends.
    monkeypatch.setattr(parallel, "_gpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "parallel_jobs", lambda: 2)
    sweep = f"hydra.sweep.dir={tmp_path / 'sweep'}"
    cfg = in_job(["hydra/launcher=parallel", "trainer=parallel_job", sweep])
    context = multiprocessing.get_context("fork")
    taken, leave = context.Queue(), context.Event()
    other = context.Process(target=_other_job, args=(cfg, 2, taken, leave))
    other.start()
    try:
        busy = taken.get(timeout=30)
        assert busy == 0  # the first free GPU
        assert parallel.job_devices() == [1]  # job 0: GPU 0 is busy, so GPU 1
        assert parallel.job_devices() == [1]  # the same GPU each time the config resolves
        parallel.release_job_device()  # job 0 ends
        _as_job(cfg, 4)
        assert parallel.job_devices() == [1]  # the GPU job 0 gave back (GPU 0 still busy)
    finally:
        parallel.release_job_device()
        leave.set()
        other.join(30)
    assert other.exitcode == 0
    _as_job(cfg, 5)
    assert parallel.job_devices() == [0]  # job 2 ended: its GPU is free again
    parallel.release_job_device()
    monkeypatch.setattr(parallel, "_gpu_count", lambda: 0)
    assert parallel.job_devices() == 1  # no GPU: the CPU


def test_the_gpu_a_job_took_from_the_pool_is_not_part_of_its_identity(in_job, monkeypatch,
                                                                      tmp_path):  # fmt: skip
    """A relaunched job that gets another GPU is the same job (same digest), so its folder,
    checkpoints and metrics stay its own; a GPU asked for by number still counts."""
    from omegaconf import open_dict

    from calm_lightning.runtime.job_state import config_digest

    def job_config(overrides):
        cfg = in_job(["hydra/launcher=parallel", "trainer=parallel_job", *overrides]).copy()
        with open_dict(cfg):
            del cfg["hydra"]  # a job's config holds no hydra node (HydraConfig has it)
        return cfg

    monkeypatch.setattr(parallel, "_gpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "parallel_jobs", lambda: 2)
    sweep = tmp_path / "sweep"
    cfg = job_config([f"hydra.sweep.dir={sweep}"])
    first = config_digest(cfg)
    assert cfg.trainer.devices == [0]
    parallel.release_job_device()  # the launch ends; on relaunch another job holds GPU 0
    other = DevicePool.for_sweep(sweep, 2, 2).take()
    try:
        assert cfg.trainer.devices == [1]
        assert config_digest(cfg) == first
    finally:
        other.release()
    assert config_digest(job_config([f"hydra.sweep.dir={sweep}", "trainer.devices=[1]"])) != first


def test_oversubscribed_jobs_spread_evenly_over_the_gpus(tmp_path):
    pool = DevicePool.for_sweep(tmp_path, gpus=2, jobs=5)  # 3 slots per GPU
    leases = [pool.take() for _ in range(5)]
    assert [lease.gpu for lease in leases] == [0, 1, 0, 1, 0]
    leases[1].release()
    leases[1] = pool.take()  # kept: a dropped lease's file closes, and its lock goes with it
    assert leases[1].gpu == 1
    assert DevicePool.for_sweep(tmp_path, gpus=2, jobs=2).take() is None  # slot 0s all held


def test_gpu_jobs_beyond_the_gpus_or_off_the_pool_are_refused(in_job, monkeypatch, tmp_path):
    monkeypatch.setattr(parallel, "_gpu_count", lambda: 2)
    sweep = f"hydra.sweep.dir={tmp_path}"
    jobs = ["hydra/launcher=parallel", "hydra.launcher.n_jobs=3", sweep]
    with pytest.raises(ConfigError, match="hydra.launcher.n_jobs=2 .*oversubscribe_gpus=true"):
        parallel.check_parallel_jobs(in_job([*jobs, "trainer=parallel_job"]))
    parallel.check_parallel_jobs(in_job([*jobs, "trainer=parallel_job", "oversubscribe_gpus=true"]))
    parallel.release_job_device()
    with pytest.raises(ConfigError, match="every job would run on the same GPU"):
        parallel.check_parallel_jobs(in_job([*jobs, "trainer.accelerator=gpu"]))
    parallel.check_parallel_jobs(in_job([*jobs, "trainer.accelerator=cpu"]))  # CPU jobs


def test_every_load_path_puts_weights_on_the_jobs_gpu(monkeypatch):
    """4-bit loading (`device_map`) and random shapes built on the GPU use the job's device, not
    LOCAL_RANK or 0 (a reference model loads through the same function)."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from calm_lightning.models import loading
    from calm_lightning.runtime import job_device

    monkeypatch.setattr(job_device, "_device", torch.device("cuda", 1))  # GPU 1 from the pool
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    seen = {}

    def from_pretrained(location, **kwargs):
        seen["device_map"] = kwargs["device_map"]
        return SimpleNamespace(config=SimpleNamespace())

    monkeypatch.setattr(transformers, "BitsAndBytesConfig", lambda **kwargs: kwargs)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    loading._load_weights("/m", {"source": "hub"}, torch.bfloat16, True, True)
    assert seen["device_map"] == {"": 1}

    small = AutoConfig.for_model("llama", vocab_size=300, hidden_size=16, intermediate_size=32,
                                 num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    built = AutoModelForCausalLM.from_config(small)

    def from_config(config, **kwargs):
        seen["default_device"] = torch.get_default_device()
        return built

    monkeypatch.setattr(AutoModelForCausalLM, "from_config", from_config)
    monkeypatch.setattr(loading, "cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: None)
    cfg = {"source": "tiny", "shape": "small", "tokenizer": "bytes", "dtype": "float32"}
    loading.load_language_model({**cfg, "quantization": "none"})
    assert seen["default_device"] == torch.device("cuda", 1)


def test_a_local_multirun_of_ddp_jobs_is_refused_but_not_through_slurm(in_job):
    # Lightning would start each job's second process by re-running the whole sweep.
    import lightning as L

    from calm_lightning.validation import check_world_size

    ddp = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False)
    assert ddp.world_size == 2
    check_world_size(ddp, retention_enabled=False)  # a single run: Lightning's launch is fine
    in_job(["trainer=ddp"])  # a job of a multirun, the basic launcher
    with pytest.raises(ConfigError, match="--multirun with 2 processes .*slurm_ddp"):
        check_world_size(ddp, retention_enabled=False)
    slurm = SimpleNamespace(creates_processes_externally=True)  # srun started every process
    check_world_size(SimpleNamespace(world_size=2, strategy=SimpleNamespace(
        cluster_environment=slurm)), retention_enabled=False)  # fmt: skip
    check_world_size(L.Trainer(accelerator="cpu", devices=1, logger=False), False)


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
