"""The exported model: the folder writer (`python -m calm_lightning.export`), its model card,
the logits processor and `load_calibrated` for using it."""
