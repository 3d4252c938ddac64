"""Parallel local sweeps: several jobs of a multirun at once on one machine, through Hydra's
joblib launcher (`hydra/launcher=parallel`, docs/running.md).

Each job is one process of its own (started and watched by one of joblib's loky workers, so a
killed job fails alone: runtime/job_process.py) with one device: `trainer=parallel_job` gives
each job a GPU no other job of the sweep holds (`${calm_job_device:}`, a pool of lock files in
the sweep's folder: runtime/device_pool.py), given back when the job ends, or the CPU, where
joblib already gives each worker cpu_count // n_jobs threads. What cannot work is refused
before any data or weights load (`check_parallel_jobs`): jobs that are themselves
multi-process (DDP / FSDP, or several devices per job) would all claim the same devices, and
Lightning would start each job's other processes by re-running the sweep's command line; on
GPUs, more jobs at once than GPUs (unless `oversubscribe_gpus=true`) and jobs that do not take
their GPU from the pool.
"""

from __future__ import annotations

import os

from omegaconf import OmegaConf

from calm_lightning.errors import ConfigError
from calm_lightning.runtime.device_pool import DevicePool, Lease
from calm_lightning.runtime.multirun import in_multirun
from calm_lightning.runtime.strategies import is_multi_process, strategy_name


def under_joblib() -> bool:
    """Whether this process runs a job of a multirun launched by Hydra's joblib launcher."""
    if not in_multirun():
        return False
    from hydra.core.hydra_config import HydraConfig

    return "joblib" in str(HydraConfig.get().launcher.get("_target_", "")).lower()


def parallel_jobs() -> int:
    """How many jobs the running multirun executes at once on this machine (1 outside a
    joblib-launched multirun; joblib's n_jobs=-1 means one per CPU core)."""
    if not under_joblib():
        return 1
    from hydra.core.hydra_config import HydraConfig

    n_jobs = int(HydraConfig.get().launcher.get("n_jobs", -1))
    return (os.cpu_count() or 1) if n_jobs < 0 else n_jobs


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def devices_per_job(trainer_cfg) -> int:
    """How many devices (processes) one job's trainer asks for."""
    devices = (trainer_cfg or {}).get("devices", 1)
    accelerator = str((trainer_cfg or {}).get("accelerator", "auto"))
    if not isinstance(devices, str) and hasattr(devices, "__len__"):  # a list of device ids
        return len(devices)
    text = str(devices).strip()
    if text in ("auto", "-1"):
        return max(1, _gpu_count()) if accelerator in ("auto", "gpu", "cuda") else 1
    if "," in text:
        return len([d for d in text.split(",") if d.strip()])
    return int(text)


def check_parallel_jobs(cfg) -> None:
    """Refuse several multi-process jobs at once on the same devices, more GPU jobs at once
    than GPUs, and GPU jobs that do not take their GPU from the pool (see the module doc)."""
    n_jobs = parallel_jobs()
    if n_jobs == 1:
        return
    trainer = cfg.get("trainer") or {}
    strategy = strategy_name(trainer)
    devices = devices_per_job(trainer)
    if is_multi_process(trainer) or devices > 1:
        raise ConfigError(
            f"hydra/launcher=parallel runs {n_jobs} jobs at once on this machine, and each job "
            f"asks for {devices} devices (trainer.strategy={strategy or 'auto'}, "
            f"trainer.devices={trainer.get('devices')}): the jobs would claim the same devices "
            "and Lightning would start each job's other processes by re-running the whole "
            "sweep. Use trainer=parallel_job (one device per job, each job its own GPU), "
            "or keep the multi-device jobs and run them one at a time (without "
            "hydra/launcher=parallel), or through SLURM (hydra/launcher=slurm_ddp)"
        )
    gpus = _gpu_count()
    if gpus == 0 or str(trainer.get("accelerator", "auto")) == "cpu":
        return
    raw = OmegaConf.to_container(trainer, resolve=False) if OmegaConf.is_config(trainer) else {}
    if "calm_job_device" not in str(raw.get("devices")):
        raise ConfigError(
            f"hydra/launcher=parallel on {gpus} GPUs with trainer.devices="
            f"{trainer.get('devices')}: every job would run on the same GPU. Use "
            "trainer=parallel_job (each job takes a GPU no other job holds)"
        )
    if n_jobs > gpus and not cfg.get("oversubscribe_gpus", False):
        raise ConfigError(
            f"hydra.launcher.n_jobs={n_jobs} jobs at once on {gpus} GPUs: some jobs would "
            f"share a GPU. Set hydra.launcher.n_jobs={gpus} (or fewer), or oversubscribe_gpus="
            "true to let up to "
            f"{-(-n_jobs // gpus)} jobs share each GPU (when their models fit in its memory)"
        )


# The GPU this process's current job took from its sweep's pool: ((sweep dir, job number), lease)
_job_lease: tuple[tuple[str, int], Lease] | None = None
POOL_WAIT_S = 120.0  # how long a job waits for a GPU to come free before it fails


def job_devices():
    """`trainer.devices` of a job of a parallel sweep: `[g]` for a GPU g taken from the sweep's
    pool and held until `release_job_device()` (the same GPU however often the config is
    resolved during the job), `[0]` outside a multirun, 1 (the CPU) without CUDA."""
    global _job_lease
    gpus = _gpu_count()
    if gpus == 0:
        return 1
    if not in_multirun():
        return [0]
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get()
    key = (str(hydra.sweep.dir), int(hydra.job.num))
    if _job_lease is not None and _job_lease[0] == key:
        return [_job_lease[1].gpu]
    release_job_device()  # a job this worker ran before
    pool = DevicePool.for_sweep(key[0], gpus, parallel_jobs())
    lease = pool.take(timeout=POOL_WAIT_S, fallback=key[1])
    if lease is None:
        raise ConfigError(
            f"job {key[1]}: none of the {gpus} GPUs came free within {POOL_WAIT_S:.0f} s "
            f"(locks under {pool.folder}): another sweep or a stuck job holds them"
        )
    _job_lease = (key, lease)
    return [lease.gpu]


def release_job_device() -> None:
    """Give the current job's GPU back to its sweep's pool (at the job's end)."""
    global _job_lease
    if _job_lease is not None:
        _job_lease[1].release()
        _job_lease = None
