"""calm-lightning: training-time calibration (CALM) of preference-aligned LLMs and its baselines.

`load_calibrated` and `CalibrationLogitsProcessor` (exported models, docs/export.md) are
imported on first use, so `import calm_lightning` stays cheap.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "load_calibrated": "calm_lightning.exported.inference",
    "CalibratedModel": "calm_lightning.exported.inference",
    "CalibrationLogitsProcessor": "calm_lightning.models.logits_processor",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
