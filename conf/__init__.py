"""The Hydra config tree (top-level `conf/` in the source tree, installed as this package)."""
