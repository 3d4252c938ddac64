"""Wall times of a run's phases, for metrics.json."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class Stopwatch:
    """Collects `<phase>_s` wall times: `with stopwatch.phase("fit"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"{name}_s"] = time.perf_counter() - start
