"""Research studies: each script runs its own `python -m calm_lightning.run` processes and
writes its records under results/ (studies/README.md). Run one as `python studies/<name>.py`
or `python -m studies.<name>` from the repository root."""
