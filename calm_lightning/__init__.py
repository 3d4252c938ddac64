"""calm-lightning: training-time calibration (CALM) of preference-aligned LLMs and its baselines."""

__version__ = "0.1.0"
