"""Checkpoints a job can trust after any kill: atomic, stamped with the job, found again.

* `AtomicCheckpointIO`: Lightning's torch checkpoint writer, but straight into a temporary
  file of the same folder, fsynced and renamed over the target, so a job killed inside a save
  leaves the previous checkpoint whole (the stray temporary file is removed at the job's next
  start).
* `JobStamp`: every checkpoint carries the job's config digest (runtime/job_state.py).
* `resolve_checkpoint`: `ckpt_path: auto` (the default) takes the newest checkpoint of the
  job's own `checkpoints/` whose stamp matches and which loads; an explicit `ckpt_path` (a
  file, or a run folder: its newest checkpoint) of another configuration is refused before any
  weights load.
* Every checkpoint is read with `torch.load(weights_only=True)` (the stamp here, and
  `Trainer.fit`, methods/training.py): tensors and plain values only, never unpickled. A
  checkpoint holds nothing else (adapters, head, optimizer and scheduler states, CALM's
  history and surrogate, the random generators' states, the loaders' positions: dicts, lists,
  numbers and tensors), so no type is added to torch's safe globals; a file that does not load
  that way (a planted pickle) is skipped under `auto` and refused when named, and never run.
* `StopForRequeue`: under submitit (the SLURM and local launchers), the timeout / preemption
  signal no longer stops the job wherever it is: training finishes its step, saves a
  checkpoint, then submitit's own handler requeues the job through the launcher's
  `checkpoint()` and exits. Lightning's own SLURM auto-requeue is switched off
  (`lightning_plugins`): one mechanism, submitit's.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from contextlib import contextmanager
from pathlib import Path

import lightning as L
from lightning.pytorch.plugins.io import TorchCheckpointIO

from calm_lightning.errors import ConfigError, first_line
from calm_lightning.runtime.distributed import is_main_process
from calm_lightning.runtime.job_state import JobFolder
from calm_lightning.runtime.run_record import CHECKPOINT_DIR, atomic_replace

log = logging.getLogger(__name__)

STAMP_KEY = "calm_lightning_job"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's torch writer, but straight into a temporary file beside the target, then
    fsync and an atomic rename (run_record.atomic_replace). Lightning's own writer serialises
    the whole checkpoint into memory first and stages it through fsspec's temporary folder:
    twice the checkpoint's size in memory and a copy across filesystems for every save."""

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        import torch

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        with atomic_replace(path) as tmp, open(tmp, "wb") as handle:
            torch.save(checkpoint, handle)


class JobStamp(L.Callback):
    """Writes the job's config digest into every checkpoint."""

    def __init__(self, digest: str) -> None:
        self.digest = digest

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[STAMP_KEY] = {"digest": self.digest}


class CheckpointRefused(Exception):
    """A checkpoint file that is not read: why, in a few words (no traceback, no unpickling)."""


def _read_stamp(path: Path) -> tuple[str | None, int]:
    """(digest, global step) of a checkpoint file, read as tensors and plain values only
    (`weights_only=True`); `CheckpointRefused` for a file that does not load that way."""
    import pickle

    import torch

    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        if found or "weights only" in str(err).lower():  # torch refused a non-tensor object
            what = f" ({found.group(1)})" if found else ""
            raise CheckpointRefused(
                f"holds objects other than tensors and plain values{what}, which only unpickling "
                "could read, and unpickling runs code: it was not unpickled"
            ) from None
        raise CheckpointRefused(f"does not load as a checkpoint ({first_line(err, 200)})") from None
    except Exception as err:  # noqa: BLE001 (cut short, not a checkpoint, unreadable)
        raise CheckpointRefused(f"does not load as a checkpoint ({first_line(err, 200)})") from None
    if not isinstance(state, dict):
        raise CheckpointRefused("is not a checkpoint (no dict of training state)")
    stamp, step = state.get(STAMP_KEY), state.get("global_step", 0)
    digest = stamp.get("digest") if isinstance(stamp, dict) else None
    if not isinstance(step, int):
        raise CheckpointRefused(f"is not a checkpoint (global_step {step!r} is no number)")
    return (None if digest is None else str(digest)), step


def _candidates(folder: Path) -> list[Path]:
    """A run folder's checkpoints, newest first (temporary files are not candidates)."""
    files = [p for p in (folder / CHECKPOINT_DIR).glob("*.ckpt") if not p.name.startswith(".")]
    return sorted(files, key=lambda p: p.stat().st_mtime_ns, reverse=True)


def resolve_checkpoint(value, own_folder: Path, digest: str) -> tuple[str | None, int]:
    """(checkpoint file to resume from or None, its global step) for `ckpt_path=value`."""
    if value in (None, "", "none", "null"):
        return None, 0
    if str(value) == "auto":
        for candidate in _candidates(own_folder):
            try:
                stamp, step = _read_stamp(candidate)
            except CheckpointRefused as why:  # never unpickled: skipped, named, an older one next
                log.warning("checkpoint %s %s; not used, trying an older one", candidate, why)
                continue
            if stamp == digest:
                log.info("resuming from %s (step %d)", candidate, step)
                return str(candidate), step
            log.warning("checkpoint %s belongs to another configuration; not used", candidate)
        return None, 0
    path = Path(str(value)).expanduser()
    if path.is_dir():
        found = _candidates(path)
        if not found:
            raise ConfigError(
                f"ckpt_path={value}: no checkpoint at {path / CHECKPOINT_DIR}/*.ckpt; pass a "
                "run folder that saved checkpoints, a .ckpt file, or ckpt_path=auto"
            )
        path = found[0]
    if not path.is_file():
        raise ConfigError(f"ckpt_path={value}: no checkpoint at {path}")
    try:
        stamp, step = _read_stamp(path)
    except CheckpointRefused as why:
        raise ConfigError(
            f"ckpt_path={value}: {path} {why}; pass a checkpoint this project wrote (a run "
            "folder's checkpoints/*.ckpt), or drop ckpt_path"
        ) from None
    if stamp is not None and stamp != digest:
        raise ConfigError(
            f"ckpt_path={value}: {path} was written by another configuration (digest {stamp}, "
            f"this run {digest}); resume with the overrides that run used, or drop ckpt_path"
        )
    return str(path), step


class StopForRequeue(L.Callback):
    """Defers submitit's timeout / preemption signal to the next step boundary (see the
    module docstring). Outside training the signal is handed to submitit at once."""

    def __init__(self) -> None:
        self.pending: tuple[int, object] | None = None
        self.training = False
        self._submitit_handler = None
        self._signal = None

    def install(self) -> bool:
        """Wrap submitit's handler of its requeue signal; False outside a submitit job."""
        if "SUBMITIT_EXECUTOR" not in os.environ:
            return False
        from submitit import JobEnvironment

        self._signal = JobEnvironment._usr_sig()
        handler = signal.getsignal(self._signal)
        if not callable(handler):
            return False
        self._submitit_handler = handler
        signal.signal(self._signal, self._on_signal)
        return True

    def _on_signal(self, signum, frame) -> None:
        if self.training:
            log.warning("requeue signal: saving a checkpoint after the current step")
            self.pending = (signum, frame)
        else:
            self._submitit_handler(signum, frame)

    def on_train_start(self, trainer, pl_module) -> None:
        self.training = True

    def on_train_end(self, trainer, pl_module) -> None:
        self.training = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.pending is None:
            return
        folder = Path(trainer.default_root_dir) / CHECKPOINT_DIR
        trainer.save_checkpoint(folder / f"requeue-step-{trainer.global_step}.ckpt")
        signum, frame = self.pending
        self.training = False
        self._submitit_handler(signum, frame)  # requeues and exits


def lightning_plugins() -> list:
    """Trainer plugins every job gets: the atomic checkpoint writer, and under SLURM an
    environment without Lightning's own auto-requeue (submitit's is the one used)."""
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    plugins: list = [AtomicCheckpointIO()]
    if SLURMEnvironment.detect():
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return plugins


@contextmanager
def claimed_job(cfg):
    """The job's folder, taken for the block: identity checked (another config's folder is
    refused), the checkpoint to resume from resolved (`ckpt_path`; a foreign one refused
    before load), the folder locked and this attempt recorded (rank 0 only under DDP).
    Yields (JobFolder, checkpoint file or None)."""
    job, main = JobFolder(cfg), is_main_process()
    if main:
        job.check_identity()
    ckpt_path, start_step = resolve_checkpoint(cfg.get("ckpt_path"), job.path, job.digest)
    try:
        if main:
            job.acquire()
            attempt = job.record_attempt(start_step, resumed=ckpt_path is not None)
            log.info("attempt %d: %s", len(job.attempts()), attempt)
        yield job, ckpt_path
    finally:
        job.release()


def job_callbacks(digest: str) -> list:
    """The callbacks every training job gets whatever `callbacks` says: the checkpoints' stamp
    and, in a submitit job, the requeue at a step boundary."""
    callbacks: list = [JobStamp(digest)]
    requeue = StopForRequeue()
    if requeue.install():
        callbacks.append(requeue)
    return callbacks
