"""The untouched model's rows, computed once per sweep and read by every later job.

Every job of a grid that changes the model scores the untouched base model first, on the same
test data with the same code: the same numbers each time. The first job stores its base row
(and its base retention row) under a fingerprint of everything the row depends on; a later job
whose fingerprint is equal reads it instead of scoring again.

What the fingerprint holds (`base_fingerprint`, `retention_fingerprint`): the model block (id,
local path, revision, dtype, quantization, logit_scale, the tiny model's shape, ...; not its
cache folder) with what the loader resolves it to (dtype, `auto` quantization as nf4 or none,
the Hub commit read from the local cache: `main` is a moving name), the test records actually
scored (their ids, in order, and a hash of their content: a changed file or limit misses), the
scoring settings (the `evaluation` block but for the keys that only decide what is compared:
letter / cloze, prompt, normalisation, option tokens, probe size, bins; for open-QA test data
its sampling, seed and clusterer), how the model was wrapped (method class, head, adapters),
the batches (eval batch size, longest prompt), the numerics (device type, the GPU's model,
precision, world size; for retention, which runs without autocast, the model's dtype and
quantization), the setting's and model's names (the reliability diagram's title) and the code
(the package version, a hash of its sources and the versions of torch / transformers / peft).
An entry whose stored fingerprint is not equal to the job's is never used.

Concurrent jobs (a parallel launcher, SLURM arrays on a shared filesystem): the first job
takes an exclusive lock on the fingerprint while it computes; the others wait on the lock and
then read. The lock is `flock`, or on filesystems without it (Lustre with `noflock`) a lock
file created atomically (runtime/file_lock.py); where neither can be had the jobs go on
unlocked, with one warning. The entry is built in a temporary folder and renamed into place,
so a reader never sees half of one, also where the lock is not honoured (the second writer's
rename fails and it keeps its own result). An entry that is a symbolic link, or that holds one,
is never used (nothing is read or copied through a link a writer of the folder planted), and
metrics.json names an entry relative to the cache root (no local path in a shareable record).

Under DDP, rank 0 alone locks, looks and writes; it tells the other ranks whether to compute.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path

from calm_lightning.runtime.file_lock import FileLock, warn_once
from calm_lightning.runtime.job_state import cache_root
from calm_lightning.runtime.run_record import (
    CACHE_ENTRY_FILE,
    read_cache_entry,
    write_cache_entry,
)

log = logging.getLogger(__name__)

# Keys of the `evaluation` block that decide what is compared or cached, not how the base
# model is scored (the rest of the block enters the fingerprint).
NOT_SCORING = (
    "compare_with_base",
    "min_accuracy_ratio",
    "retention",
    "base_cache",
    "base_cache_dir",
    "heldout_metrics",  # the method's held-out pass, after calibration: not the base row
)
# Keys of the model block that say where files go, not which model it is.
NOT_MODEL = ("cache_dir",)
# How long a job waits for another job's lock on a fingerprint (that job scoring the base row)
# before it scores the row itself.
LOCK_WAIT_S = 2 * 3600


def _canonical(payload) -> str:
    return json.dumps(payload, sort_keys=True, default=str, separators=(",", ":"))


def _sha256(text: str | bytes) -> str:
    data = text.encode() if isinstance(text, str) else text
    return hashlib.sha256(data).hexdigest()


def records_digest(records: list) -> dict:
    """The test records scored, by identity: their ids in order and a hash of their content
    (every field of every record, in order)."""
    rows = [asdict(r) if is_dataclass(r) else dict(r) for r in records]
    return {
        "n": len(rows),
        "ids": [str(r.get("id", "")) for r in rows],
        "sha256": _sha256(_canonical(rows)),
    }


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (a retention task's local data)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


@functools.cache
def code_version() -> dict:
    """The scoring code's version: the package's version, a hash of every source file of the
    package (a change anywhere invalidates: cheaper than a wrong row) and the libraries'."""
    from importlib.metadata import PackageNotFoundError, version

    import calm_lightning

    package = Path(calm_lightning.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes())
    libraries = {}
    for name in ("torch", "transformers", "peft"):
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            libraries[name] = None
    return {
        "calm_lightning": calm_lightning.__version__,
        "sources": digest.hexdigest(),
        **libraries,
    }


@dataclass(frozen=True)
class Fingerprint:
    """What a cached row depends on (`inputs`) and its digest (the entry's name)."""

    kind: str  # "base" | "retention_base"
    inputs: dict

    @property
    def digest(self) -> str:
        return _sha256(_canonical(self.inputs))

    @property
    def entry_name(self) -> str:
        return f"{self.kind}-{self.digest[:20]}"


def _plain(node) -> dict:
    from omegaconf import DictConfig, OmegaConf

    if node is None:
        return {}
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node


def _wrapping(cfg, method_cls) -> dict:
    """How the scored model was built from the loaded one: the method's class, its head and
    (when the method attaches them) its adapters. Zero-initialised adapters and an identity
    head leave the logits as they are, but a centred head, for one, not to the last bit."""
    return {
        "method_class": f"{method_cls.__module__}.{method_cls.__qualname__}",
        "head": _plain(cfg.method.get("head")) if method_cls.head else None,
        "peft": _plain(cfg.get("peft")) if method_cls.uses_adapter else None,
    }


def _model(cfg) -> dict:
    """The model block, and what the loader resolves it to here (`auto` quantization and dtype,
    the revision actually read: a moving `main` resolves to its commit)."""
    from calm_lightning.models.loading import resolved_choices

    block = {k: v for k, v in _plain(cfg.model).items() if k not in NOT_MODEL}
    return {**block, "resolved": resolved_choices(block)}


def device_name(device) -> str:
    """The GPU's model name ("NVIDIA H100 80GB HBM3"), or the device type off CUDA."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _numerics(trainer) -> dict:
    device = trainer.strategy.root_device
    return {
        "device": device.type,
        "device_name": device_name(device),
        "precision": str(trainer.precision),
        "world_size": int(trainer.world_size),
    }


def base_fingerprint(cfg, method_cls, test_records: list, trainer) -> Fingerprint:
    """The fingerprint of the base row of a run (see the module doc)."""
    evaluation = {k: v for k, v in _plain(cfg.evaluation).items() if k not in NOT_SCORING}
    from calm_lightning.data.records import OpenQARecord

    if not any(isinstance(r, OpenQARecord) for r in test_records[:1]):
        # Multiple-choice scoring never samples: the open-QA block (whose seed follows the
        # run's) does not enter, so the jobs of a seeds grid share one base row.
        evaluation.pop("openqa", None)
    setting = cfg.setting
    return Fingerprint(
        "base",
        {
            "model": _model(cfg),
            "test": records_digest(test_records),
            "scoring": evaluation,
            "batches": {
                "eval_batch_size": setting.get("eval_batch_size"),
                "eval_max_length": setting.get("eval_max_length"),
            },
            "wrapping": _wrapping(cfg, method_cls),
            "numerics": _numerics(trainer),
            "labels": {"model": cfg.model.get("name"), "setting": setting.get("name")},
            "code": code_version(),
        },
    )


def retention_fingerprint(cfg, method_cls, settings) -> Fingerprint:
    """The fingerprint of the base retention row: the model, the lm-eval tasks with the hash
    of each local data file (tasks read from the Hub are named, at lm-eval's version), the
    limit, batch size and bins, and the code."""
    from importlib.metadata import version

    import torch

    model, device = _model(cfg), "cuda" if torch.cuda.is_available() else "cpu"
    return Fingerprint(
        "retention_base",
        {
            "model": model,
            "tasks": list(settings.tasks),
            "data_files": {
                task: [[str(p), file_digest(p)] for p in paths]
                for task, paths in sorted(settings.data_files.items())
            },
            "limit": settings.limit,
            "batch_size": settings.batch_size,
            "n_bins": settings.n_bins,
            "lm_eval": version("lm_eval"),
            "wrapping": _wrapping(cfg, method_cls),
            # lm-eval runs the model as loaded (no autocast): its dtype and 4-bit-ness are the
            # precision, on the current device (the job's GPU)
            "numerics": {
                "device": device,
                "device_name": device_name(device),
                "dtype": model["resolved"]["dtype"],
                "quantization": model["resolved"]["quantization"],
            },
            "code": code_version(),
        },
    )


@contextmanager
def _exclusive(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created), held until the block ends. Where no lock can be
    had (no flock and no atomic file creation, or a holder on another host that never lets go
    within LOCK_WAIT_S) the block runs unlocked, with one warning: jobs may then score the same
    row twice, and the atomic rename in `_store` still keeps every entry whole."""
    lock = FileLock(path)
    if not lock.acquire(timeout=LOCK_WAIT_S):
        warn_once(
            f"base-cache:{path.parent}",
            "base cache: no lock on %s; going on without it (a concurrent job may score the "
            "same base row)",
            path,
        )
    try:
        yield
    finally:
        lock.release()


class BaseCache:
    """The cache of one run: `root` (None = off). `fetch` hands back an entry's folder to read
    from, or computes and stores one."""

    def __init__(self, root: Path | None) -> None:
        self.root = root

    @classmethod
    def from_config(cls, cfg) -> BaseCache:
        return cls(cache_root(cfg))

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def entry(self, record: dict) -> Path:
        """The folder of the entry a `fetch` record names (relative to the cache root)."""
        return self.root / record["entry"]

    def _matching_entry(self, fingerprint: Fingerprint) -> Path | None:
        entry = self.root / fingerprint.entry_name
        if _holds_links(entry):
            log.warning("%s: a symbolic link in the cache entry; not used", entry)
            return None
        stored = read_cache_entry(entry)
        if stored is None:
            return None
        if stored.get("inputs") != json.loads(_canonical(fingerprint.inputs)):
            log.warning("%s: stored fingerprint differs from this run's; not used", entry)
            return None
        return entry

    def fetch(
        self, fingerprint: Fingerprint, compute: Callable[[], dict], files: Path | None = None
    ) -> tuple[dict, dict]:
        """(payload, record). A matching entry: its payload, record status `read` (the entry's
        other files are in `entry(record)`). Otherwise `compute()` runs (it returns the JSON
        payload and writes its files to the folder `files`) and, with the cache on, the
        payload and `files` are stored: status `computed`. With the cache off: status `off`.
        The record names the fingerprint's digest, as metrics.json keeps it."""
        from calm_lightning.runtime.distributed import gather_objects, is_main_process

        record = {"status": "off", "fingerprint": fingerprint.digest}
        if not self.enabled:
            return compute(), record
        record["entry"] = fingerprint.entry_name  # relative to the cache root: `entry(record)`
        main = is_main_process()
        lock = self.root / f".{fingerprint.entry_name}.lock"
        with _exclusive(lock) if main else _nothing():
            entry = self._matching_entry(fingerprint) if main else None
            # Rank 0 decides for every rank (one process: its own decision).
            found = gather_objects(None if entry is None else str(entry))[0]
            if found is not None:
                stored = read_cache_entry(Path(found))
                return stored["payload"], {**record, "status": "read"}
            payload = compute()
            if main:
                self._store(fingerprint, payload, files)
            return payload, {**record, "status": "computed"}

    def _store(self, fingerprint: Fingerprint, payload: dict, files: Path | None) -> None:
        """Build the entry in a temporary folder, then rename it into place (atomic)."""
        self.root.mkdir(parents=True, exist_ok=True)
        # This job holds the entry's lock: a temporary folder of this entry is a killed
        # writer's, never another live one's (where no lock could be had, a live writer's
        # rename then fails and it keeps its own result, as below).
        for stale in self.root.glob(f".{fingerprint.entry_name}.*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{fingerprint.entry_name}."))
        try:
            if files is not None and files.is_dir():
                for path in sorted(files.iterdir()):
                    if path.is_file() and not path.is_symlink():
                        shutil.copyfile(path, tmp / path.name)
            write_cache_entry(
                tmp,
                {
                    "kind": fingerprint.kind,
                    "digest": fingerprint.digest,
                    "inputs": fingerprint.inputs,
                    "payload": payload,
                },
            )
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the sweep's files are not
            os.rename(tmp, self.root / fingerprint.entry_name)
        except OSError as err:  # another job stored it first (no lock on this filesystem)
            log.warning("base cache: %s not stored (%s)", fingerprint.entry_name, err)
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def restore(entry: str | Path, folder: Path) -> None:
        """Copy an entry's files (not its own record, never through a symbolic link) into a
        run's folder."""
        folder.mkdir(parents=True, exist_ok=True)
        for path in sorted(Path(entry).iterdir()):
            if path.is_symlink():
                log.warning("%s is a symbolic link; not copied from the base cache", path)
            elif path.is_file() and path.name != CACHE_ENTRY_FILE:
                shutil.copyfile(path, folder / path.name)


def _holds_links(entry: Path) -> bool:
    """Whether a cache entry is, or holds, a symbolic link."""
    if entry.is_symlink():
        return True
    return entry.is_dir() and any(path.is_symlink() for path in entry.iterdir())


@contextmanager
def _nothing() -> Iterator[None]:
    yield
