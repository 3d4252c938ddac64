"""Calibration metrics and post-hoc calibrators."""
