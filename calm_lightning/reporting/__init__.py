"""Sweep aggregation: selection rule, paper-style tables, reliability-diagram grids."""
