"""The exported model: the folder writer (`python -m calm_lightning.export`), its model card
and `load_calibrated` for using it; the logits processor it copies into the folder lives beside
the head it applies (models/logits_processor.py)."""
