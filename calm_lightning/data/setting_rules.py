"""The rules of a `setting` node's own keys (conf/setting/*.yaml): its name and how the data
module batches and cuts its splits (the splits' sources check their own arguments)."""

from __future__ import annotations

from calm_lightning.config_rules import Number, Text

SETTING_RULES = {
    "name": Text(required=True),
    "batch_size": Number(minimum=1, integer=True, required=True),
    # null (or absent) = batch_size, as CalibrationDataModule reads it
    "heldout_batch_size": Number(minimum=1, integer=True, optional=True),
    "eval_batch_size": Number(minimum=1, integer=True, required=True),
    "max_length": Number(minimum=1, integer=True, required=True),
    "eval_max_length": Number(minimum=1, integer=True, required=True),
    "num_workers": Number(minimum=0, integer=True, required=True),
}
