"""A job's identity and life in its folder: what makes a relaunched sweep finish.

Relaunching a sweep with the same `hydra.sweep.dir` maps every job to the folder it had
(Hydra names job folders by their number and overrides). In that folder:

* `job.json` holds the digest of the job's resolved config (`config_digest`: everything but
  paths, launcher, logger, checkpoint cadence, display keys and the GPU a parallel job took
  from its pool). A folder whose digest differs is another job's: it is refused, naming both
  configs, never mixed or overwritten.
* A job whose `metrics.json` exists with the same digest is finished: the launcher gets its
  stored objective back without a model being loaded or a file being touched.
* One process at a time writes a job folder (`.job.lock`, held for the job's life): a second
  one is refused, and so is one that cannot open the lock (another user's: counted as held).
* The folders a job trusts (its own, its checkpoints, the sweep's, the base cache's) must be
  this user's and writable by no one else: whoever can write there could plant a checkpoint,
  a metrics.json that marks the job finished, or a base-cache entry. Another's folder, or one
  writable by group or others (a user's private group aside), is refused with the fix, or
  accepted with a warning under `allow_shared_folder=true` (docs/security.md).
* `attempts.jsonl` gets a line at every start, before any work: `{start_step, started_at,
  reason}` with reason `fresh` (nothing to resume), `resume` (a checkpoint of this job found)
  or `requeue` (the launcher started it again: SLURM's restart count, or submitit after an
  earlier attempt), and the error of a failed earlier attempt (its failed.json, which the new
  attempt takes over); `metrics.json` carries the list as `attempts`.

Where the checkpoints come from and how they are found: runtime/checkpointing.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path

from calm_lightning.errors import ConfigError
from calm_lightning.runtime.file_lock import FileLock, warn_once
from calm_lightning.runtime.run_record import (
    BASE_CACHE_DIR,
    CHECKPOINT_DIR,
    CONFIG_FILE,
    FAILED_FILE,
    METRICS_FILE,
    _write_json,
)

IDENTITY_FILE = "job.json"
ATTEMPTS_FILE = "attempts.jsonl"
JOB_LOCK_FILE = ".job.lock"

# Keys that say where or how a job runs, not what it computes: two configs that differ only
# here are the same job. `trainer.default_root_dir` is the output folder again; `callbacks`
# only sets checkpoint cadence; the base-row cache is a shortcut to the same numbers.
IGNORED_KEYS = (
    "paths",
    "hydra",
    "logger",
    "ckpt_path",
    "callbacks",
    "oversubscribe_gpus",
    # Whether a shared folder is accepted decides whether the job starts, not what it computes.
    "allow_shared_folder",
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.log_every_n_steps",
    "evaluation.base_cache",
    "evaluation.base_cache_dir",
    # What plan and report read about a method (conf/method/*.yaml): not what the job computes,
    # so a sweep folder started before a trait changed still holds the same jobs.
    "method.traits",
)


def config_digest(cfg) -> str:
    """A short digest of what the job computes (its resolved config without IGNORED_KEYS)."""
    from omegaconf import OmegaConf

    tree = OmegaConf.to_container(cfg, resolve=True)
    # A parallel sweep's job runs on whichever GPU of the sweep's pool is free when it starts
    # (`${calm_job_device:}` resolves to [g], runtime/parallel.py): where it runs, not what it
    # computes, so a relaunch that gets another GPU is the same job. The digest keeps the
    # request instead (on the CPU it resolves to 1, kept as it is).
    trainer = OmegaConf.select(cfg, "trainer", default=None)
    requested = OmegaConf.to_container(trainer) if OmegaConf.is_config(trainer) else {}
    if "calm_job_device" in str(requested.get("devices")) and isinstance(
        tree["trainer"].get("devices"), list
    ):
        tree["trainer"]["devices"] = requested["devices"]
    drop_keys(tree, IGNORED_KEYS)
    text = json.dumps(tree, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def drop_keys(tree: dict, dotted_keys) -> None:
    """Remove each dotted key (`a.b.c`) from a plain config tree, in place; a missing one is
    skipped."""
    for dotted in dotted_keys:
        *parents, leaf = dotted.split(".")
        node = tree
        for key in parents:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)


def sweep_folder() -> Path | None:
    """The sweep's folder in a multirun (every job of the sweep shares it), else None."""
    from calm_lightning.runtime.multirun import in_multirun

    if not in_multirun():
        return None
    from hydra.core.hydra_config import HydraConfig

    return Path(str(HydraConfig.get().sweep.dir))


def cache_root(cfg) -> Path | None:
    """Where a run's base cache lives (evaluation/base_cache.py): `evaluation.base_cache_dir`,
    else the sweep's folder in a multirun, else the run's own folder; None when
    `evaluation.base_cache=false`."""
    evaluation = cfg.get("evaluation") or {}
    if not evaluation.get("base_cache", True):
        return None
    folder = evaluation.get("base_cache_dir") or sweep_folder() or cfg.paths.output_dir
    return Path(str(folder)).expanduser() / BASE_CACHE_DIR


def _name(lookup, key: int) -> str:
    try:
        return lookup(key)[0]
    except KeyError:
        return str(key)


def _private_group(gid: int) -> bool:
    """A user private group: named as this user, no other member (systems that use them set
    umask 002, so every folder is group-writable and yet no one else's)."""
    import grp
    import pwd

    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return False
    return group.gr_name == user and set(group.gr_mem) <= {user}


def folder_risk(path: Path) -> str | None:
    """What makes `path` (a folder a job trusts) writable by someone else; None: nothing."""
    import grp
    import pwd

    info = path.stat()  # a symbolic link is judged by the folder it leads to
    if info.st_uid != os.getuid():
        return f"belongs to {_name(pwd.getpwuid, info.st_uid)}, not to you"
    if info.st_mode & stat.S_IWOTH:
        return "is writable by every user"
    if info.st_mode & stat.S_IWGRP and not _private_group(info.st_gid):
        return f"is writable by the group {_name(grp.getgrgid, info.st_gid)}"
    return None


def check_folders(cfg, job_path: Path) -> None:
    """Refuse a folder the job trusts (its own, its checkpoints, the sweep's, the base
    cache's) that another can write; `allow_shared_folder=true` accepts it, loudly."""
    cache = cache_root(cfg)
    candidates = [job_path, job_path / CHECKPOINT_DIR, sweep_folder()]
    candidates += [cache.parent, cache] if cache is not None else []
    seen: set[Path] = set()
    for folder in candidates:
        if folder is None or folder in seen or not folder.is_dir():
            continue
        seen.add(folder)
        risk = folder_risk(folder)
        if risk is None:
            continue
        if cfg.get("allow_shared_folder", False):
            warn_once(
                f"shared:{folder}",
                "allow_shared_folder=true: %s %s; its checkpoints, finished-job records and "
                "base-cache entries are trusted as this job's own",
                folder,
                risk,
            )
            continue
        raise ConfigError(
            f"{folder} {risk}: whoever can write there could plant checkpoints, records that "
            "mark a job finished, or base-cache entries that this job would trust. Use a "
            f"folder of your own (`chmod go-w {folder}`, or a new hydra.sweep.dir), or accept "
            "the risk with allow_shared_folder=true (docs/security.md)"
        )


def _read_json(path: Path):
    """A record file's content (None when missing); a corrupt one is a one-line error."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{path} is corrupt ({err}); move it out of the job folder (or delete it) and "
            "relaunch: the job then runs again"
        ) from None


def _stray_temporaries(folder: Path) -> list[Path]:
    """Temporary files a killed atomic write left (run_record.atomic_replace names them
    `.<name>.<random>`); the job lock and its fallback owner file (`.job.lock.owner`, the lease
    this process holds) are not temporaries."""
    out = []
    for sub in (folder, folder / "checkpoints", folder / "base"):
        if sub.is_dir():
            out += [
                p
                for p in sub.iterdir()
                if p.is_file()
                and p.name.startswith(".")
                and p.name.count(".") >= 2
                and not p.name.startswith(JOB_LOCK_FILE)
            ]
    return out


class JobFolder:
    """One job's folder as the job sees it (see the module docstring)."""

    def __init__(self, cfg, folder: str | Path | None = None) -> None:
        self.cfg = cfg
        self.path = Path(folder if folder is not None else cfg.paths.output_dir)
        self.digest = config_digest(cfg)
        self._lock = FileLock(self.path / JOB_LOCK_FILE)

    # ----- identity -----
    def stored_digest(self) -> str | None:
        record = _read_json(self.path / IDENTITY_FILE)
        return record.get("digest") if isinstance(record, dict) else None

    def check_identity(self) -> None:
        """Refuse a folder that others can write (`check_folders`) or that holds another job
        (its digest differs, or it holds a run written before digests existed)."""
        check_folders(self.cfg, self.path)
        stored = self.stored_digest()
        if stored is None:
            if (self.path / CONFIG_FILE).is_file() and not (self.path / IDENTITY_FILE).exists():
                raise ConfigError(
                    f"{self.path} already holds a run without a job identity ({IDENTITY_FILE}); "
                    "it may be another job: launch into a new hydra.sweep.dir, or move that "
                    "folder away"
                )
            return
        if stored != self.digest:
            raise ConfigError(
                f"{self.path} holds another job (config digest {stored}, this job {self.digest}; "
                f"its config: {self.path / CONFIG_FILE}): a relaunched sweep must use the same "
                "command and grid; launch this one into a new hydra.sweep.dir, or move the old "
                "folder away (nothing was changed in it)"
            )

    # ----- finished jobs -----
    def finished_summary(self) -> dict | None:
        """metrics.json of this very job, when it finished (None otherwise)."""
        if self.stored_digest() != self.digest:
            return None
        summary = _read_json(self.path / METRICS_FILE)
        return summary if isinstance(summary, dict) and "metrics" in summary else None

    # ----- one writer -----
    def acquire(self) -> None:
        """Take the folder for this process's life; refuse when another process holds it."""
        self.path.mkdir(parents=True, exist_ok=True)
        if not self._lock.acquire(blocking=False) and self._lock.denied:
            raise ConfigError(
                f"{self._lock.denied}, so the job in {self.path} counts as run by another "
                "process and is not started; if no one runs it, that file's owner can remove "
                "it, or launch into a folder of your own"
            )
        if not self._lock.held and not self._lock.unavailable:
            raise ConfigError(
                f"another process is running the job in {self.path} (it holds "
                f"{self.path / JOB_LOCK_FILE}); wait for it, or stop it first"
            )
        for stray in _stray_temporaries(self.path):  # ours alone now: a dead writer's
            stray.unlink(missing_ok=True)
        # An earlier attempt's failure goes into this attempt's record: the folder then says
        # what it is now (running, then finished or failed again), and nothing is lost.
        failed = self.path / FAILED_FILE
        self._previous_failure = None
        if failed.is_file():
            record = _read_json(failed)
            self._previous_failure = (record or {}).get("error", "failed")
            failed.unlink()
        if self.stored_digest() is None:
            _write_json(self.path / IDENTITY_FILE, {"digest": self.digest})

    def release(self) -> None:
        self._lock.release()

    # ----- attempts -----
    def attempts(self) -> list[dict]:
        path = self.path / ATTEMPTS_FILE
        if not path.is_file():
            return []
        out = []
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill mid-write
                continue
        return out

    def record_attempt(self, start_step: int, resumed: bool) -> dict:
        """Append this start (before any work, so a killed attempt counts too)."""
        if launcher_restart(bool(self.attempts())):
            reason = "requeue"
        else:
            reason = "resume" if resumed else "fresh"
        entry = {
            "start_step": int(start_step),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "reason": reason,
        }
        if getattr(self, "_previous_failure", None):
            entry["previous_failure"] = self._previous_failure
        with open(self.path / ATTEMPTS_FILE, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(entry) + "\n")
            stream.flush()
            os.fsync(stream.fileno())
        return entry


def launcher_restart(had_attempts: bool) -> bool:
    """Whether the launcher started this job again: SLURM counts its requeues; submitit's
    local executor does not, so there an earlier attempt of a submitit job is the sign."""
    if int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
        return True
    return had_attempts and "SUBMITIT_EXECUTOR" in os.environ
