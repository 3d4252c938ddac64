"""Calibration metrics (ECE family, Brier, NLL, Sem-ECE with its answer clustering) and
reliability diagrams: predictions in, numbers and plots out."""
