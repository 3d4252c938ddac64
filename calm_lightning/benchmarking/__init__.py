"""Cost measurements the GPU acceptance check runs (`python -m calm_lightning check`), shipped
with the package so an installed copy can run them; benchmarks/ holds their command lines and
the measurements that stay in the repository."""
