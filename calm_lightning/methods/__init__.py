"""One LightningModule per method family; all share the MCQA evaluation of `CalibrationMethod`."""
