"""Hydra config tree (a package so Hydra finds it when installed)."""
