"""Whether this process runs a job of a Hydra multirun (a sweep), asked by the modules that
behave differently there (parallel jobs, loggers, the base cache, the entry point)."""

from __future__ import annotations


def in_multirun() -> bool:
    """True inside a job of a Hydra multirun (sweep)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
