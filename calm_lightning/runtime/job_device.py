"""The device a job's weights belong on, for the loaders that place weights themselves (4-bit
models, random-weight shapes built on the GPU, reference models).

The pipeline sets it from the trainer as soon as the trainer exists (`set_job_device`): the
GPU a parallel sweep's job took from its pool, the `trainer.devices` entry of a DDP process's
local rank, or the CPU. It also makes that GPU the current CUDA device, so that every
`"cuda"` without an index means it. Callers outside the pipeline (export, the retention
command, benchmarks) get the local rank's GPU under a launcher, else the current one.
"""

from __future__ import annotations

import os

import torch

_device: torch.device | None = None


def set_job_device(device: torch.device | str) -> None:
    """This process's job runs on `device` (its trainer's root device)."""
    global _device
    _device = torch.device(device)
    if _device.type == "cuda":
        torch.cuda.set_device(_device)


def job_cuda_device() -> torch.device:
    """The CUDA device this job's weights go on (only asked where CUDA is available)."""
    if _device is not None and _device.type == "cuda":
        return _device
    if os.environ.get("LOCAL_RANK") not in (None, ""):
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())
