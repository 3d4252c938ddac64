"""Parallel local sweeps: several jobs of a multirun at once on one machine, through Hydra's
joblib launcher (`hydra/launcher=parallel`, docs/running.md).

Each job is one process (joblib's loky workers) with one device: `trainer=parallel_job` puts
job k on GPU k mod the number of GPUs (`${calm_job_device:}`), or on the CPU, where joblib
already gives each worker cpu_count // n_jobs threads. What cannot work is refused before
any data or weights load (`check_parallel_jobs`): jobs that are themselves multi-process
(DDP / FSDP, or several devices per job) would all claim the same devices, and Lightning would
start each job's other processes by re-running the sweep's command line.
"""

from __future__ import annotations

import os

from calm_lightning.errors import ConfigError
from calm_lightning.runtime.multirun import in_multirun
from calm_lightning.runtime.strategies import is_multi_process, strategy_name


def parallel_jobs() -> int:
    """How many jobs the running multirun executes at once on this machine (1 outside a
    joblib-launched multirun; joblib's n_jobs=-1 means one per CPU core)."""
    if not in_multirun():
        return 1
    from hydra.core.hydra_config import HydraConfig

    launcher = HydraConfig.get().launcher
    if "joblib" not in str(launcher.get("_target_", "")).lower():
        return 1
    n_jobs = int(launcher.get("n_jobs", -1))
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
    """Refuse several multi-process jobs at once on the same devices (see the module doc)."""
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
            "sweep. Use trainer=parallel_job (one device per job: job k on GPU k mod the GPUs), "
            "or keep the multi-device jobs and run them one at a time (without "
            "hydra/launcher=parallel), or through SLURM (hydra/launcher=slurm_ddp)"
        )


def job_devices():
    """`trainer.devices` of a job of a parallel sweep: `[k mod n_gpus]` on CUDA (job number
    k), else 1 (the CPU)."""
    gpus = _gpu_count()
    if gpus == 0:
        return 1
    if not in_multirun():
        return [0]
    from hydra.core.hydra_config import HydraConfig

    return [int(HydraConfig.get().job.num) % gpus]
