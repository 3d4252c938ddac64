"""Datasets, prompt formatting and collation; one module per dataset family."""
