"""A run's plumbing, the lowest layer of the package (docs/architecture.md, "Layers"): the run
record, data parallelism and strategies, loggers, resolvers, the job's device, locks, job state
and checkpoints, method settings, timing. It imports nothing of the project outside runtime/
but errors.py and config_rules.py."""
