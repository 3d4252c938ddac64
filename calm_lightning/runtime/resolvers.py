"""OmegaConf resolvers used by the config tree and run-time choices derived from the hardware.

torch is imported when a resolver runs, not when they are registered: the planner composes
configs with these resolvers registered and never resolves them, and stays torch-free."""

from __future__ import annotations

from omegaconf import OmegaConf


def cuda_available() -> bool:
    """True when a CUDA device can be used (the GPU path: bf16, 4-bit QLoRA)."""
    import torch

    return torch.cuda.is_available()


def auto_precision() -> str:
    """Lightning precision for `precision: auto`: bf16 mixed on a bf16-capable GPU, fp32
    otherwise (CPU, and GPUs without bf16 such as V100 / T4).

    fp32 on CPU although bf16 is ~3x faster there: bf16 moves option probabilities by up to
    0.05 and flips the argmax on ~6 % of questions (docs/platform.md), which calibration
    metrics cannot tolerate. Not fp16 on older GPUs: CALM writes its direction into `.grad`
    by hand, which fp16 loss scaling cannot handle, and the default method must run.
    """
    import torch

    if cuda_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def resolve_precision(value: str | int) -> str | int:
    """Map `auto` to the hardware default, pass anything else to Lightning unchanged."""
    return auto_precision() if str(value) == "auto" else value


def job_devices():
    """`${calm_job_device:}`: runtime/parallel.py's `job_devices` (imported when resolved: the
    parallel launcher's helpers import torch)."""
    from calm_lightning.runtime.parallel import job_devices as devices

    return devices()


def register_resolvers() -> None:
    """Register `${calm_precision:auto}` and `${calm_job_device:}` (one device per job of a
    parallel sweep, runtime/parallel.py); safe to call more than once."""
    if not OmegaConf.has_resolver("calm_precision"):
        OmegaConf.register_new_resolver("calm_precision", resolve_precision)
    if not OmegaConf.has_resolver("calm_job_device"):
        OmegaConf.register_new_resolver("calm_job_device", job_devices)


register_resolvers()
