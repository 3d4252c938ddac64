"""Evaluation: running benchmarks and plotting reliability diagrams."""
