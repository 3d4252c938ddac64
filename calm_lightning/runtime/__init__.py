"""What a run needs around the methods: the run record (the run directory's files), config
checks, loggers, data parallelism and strategies, resolvers, method settings, timing."""
