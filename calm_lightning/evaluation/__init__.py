"""Evaluation: getting predictions from a model (MCQA option scoring, answer sampling for
open QA, parsing stated answers) and writing result files."""
