"""GPUs handed out to the jobs of a parallel local sweep (hydra/launcher=parallel).

joblib gives the next job to whichever worker frees first, so a job's number says nothing
about which GPUs are busy. Instead each job takes a free GPU from a pool and gives it back when
it ends: one lock file per GPU (and per slot, where several jobs may share a GPU) in a folder
of the sweep, held for the job's life (runtime/file_lock.py: `flock`, released by the kernel
if the job dies, or an atomically created file whose dead owner is taken over). The folder is
per host, so jobs of one sweep on several machines never wait on each other's GPUs.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from calm_lightning.runtime.file_lock import POLL_S, FileLock

log = logging.getLogger(__name__)

POOL_DIR = ".gpu_pool"


@dataclass
class Lease:
    """One GPU taken from a pool; `release()` gives it back."""

    gpu: int
    lock: FileLock | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


class DevicePool:
    """`gpus` GPUs, each with `slots` places (1 = one job per GPU), under `folder`."""

    def __init__(self, folder: str | Path, gpus: int, slots: int = 1) -> None:
        self.folder = Path(folder) / POOL_DIR / socket.gethostname()
        self.gpus, self.slots = int(gpus), max(1, int(slots))

    @classmethod
    def for_sweep(cls, sweep_dir: str | Path, gpus: int, jobs: int) -> DevicePool:
        """The pool of a sweep running `jobs` at once: as many slots per GPU as needed."""
        return cls(sweep_dir, gpus, -(-max(jobs, 1) // gpus))

    def _locks(self):
        # Slot 0 of every GPU first, then slot 1 ...: oversubscribed jobs spread evenly.
        for slot in range(self.slots):
            for gpu in range(self.gpus):
                yield gpu, FileLock(self.folder / f"gpu{gpu}-slot{slot}.lock")

    def take(self, timeout: float = 0.0, fallback: int = 0) -> Lease | None:
        """A free GPU, waiting up to `timeout` seconds for one; None if none came free. Where
        no lock can be taken at all, GPU `fallback` (mod the GPUs) unlocked, logged."""
        deadline = time.monotonic() + timeout
        while True:
            unavailable = True
            for gpu, lock in self._locks():
                if lock.acquire(blocking=False):
                    return Lease(gpu, lock)
                unavailable = unavailable and lock.unavailable
            if unavailable:
                gpu = fallback % self.gpus
                log.warning("no lock under %s: this job takes GPU %d unchecked", self.folder, gpu)
                return Lease(gpu, None)
            if time.monotonic() >= deadline:
                return None
            time.sleep(POLL_S)
