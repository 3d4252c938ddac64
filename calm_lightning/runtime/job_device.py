"""The device a job's weights belong on, for the loaders that place weights themselves (4-bit
models, random-weight shapes built on the GPU, unquantized hub loads, reference models).

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
_place_weights = False


def set_job_device(device: torch.device | str, place_weights: bool = True) -> None:
    """This process's job runs on `device` (its trainer's root device). `place_weights`:
    unquantized loads put their weights straight there (`weights_device`); off under a
    strategy that shards the model from the CPU (FSDP)."""
    global _device, _place_weights
    _device = torch.device(device)
    _place_weights = place_weights
    if _device.type == "cuda":
        torch.cuda.set_device(_device)


def weights_device() -> torch.device | None:
    """The GPU an unquantized load reads its weights onto (transformers' `device_map`), so that
    a model never sits whole in host memory (Gemma-3-27B in bf16 is 54 GB, SLURM's `mem_gb` 64):
    the job's GPU, the one its trainer computes on and LoRA's adapters are then made on (peft
    creates them beside their base layer). None, load on the CPU and let the trainer move the
    model, where no pipeline set a CUDA device (CPU jobs, tests, export, the retention
    command) or the strategy shards the model (FSDP)."""
    if _device is not None and _device.type == "cuda" and _place_weights:
        return _device
    return None


def job_cuda_device() -> torch.device:
    """The CUDA device this job's weights go on (only asked where CUDA is available)."""
    if _device is not None and _device.type == "cuda":
        return _device
    if os.environ.get("LOCAL_RANK") not in (None, ""):
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    return torch.device("cuda", torch.cuda.current_device())
