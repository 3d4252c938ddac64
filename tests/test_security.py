"""What others hand us is data, never code, and what we hand out names no local folder
(docs/security.md): planted checkpoints are never unpickled, a received run folder's config
imports nothing and resolves nothing, `overwrite=true` deletes only an earlier export, shared
folders are refused at claim time, the lock's lease fallback keeps two holders apart, and the
shareable records carry no absolute path."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from calm_lightning.errors import ConfigError, ExportError
from calm_lightning.runtime import file_lock
from calm_lightning.runtime.checkpointing import STAMP_KEY, resolve_checkpoint
from calm_lightning.runtime.file_lock import FileLock
from calm_lightning.runtime.job_state import JOB_LOCK_FILE, JobFolder
from calm_lightning.runtime.run_record import CONFIG_FILE, FAILED_FILE

ROOT = Path(__file__).resolve().parents[1]
JOB = ["model=tiny", "method=calm", "logger=none"]


# ----- checkpoints: tensors and plain values only -----


class Planted:
    """What a planted checkpoint carries: unpickling it creates `marker` (any code could run)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _checkpoint(path: Path, state: dict, age_s: float = 0.0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    stamp = time.time() - age_s
    os.utime(path, (stamp, stamp))
    return path


def _planted(path: Path, marker: Path) -> Path:
    state = {"global_step": 9, STAMP_KEY: {"digest": "mine"}, "loops": Planted(marker)}
    return _checkpoint(path, state)


def test_the_planted_checkpoint_would_run_code_if_unpickled(tmp_path):
    """The fixture is real: torch's full unpickler runs its payload (so the tests below mean
    something)."""
    planted = _planted(tmp_path / "planted.ckpt", tmp_path / "marker")
    torch.load(planted, weights_only=False)
    assert (tmp_path / "marker").exists()


def test_a_planted_checkpoint_is_skipped_under_auto_and_never_unpickled(tmp_path, caplog):
    folder, marker = tmp_path / "job", tmp_path / "marker"
    good = _checkpoint(
        folder / "checkpoints" / "step-3.ckpt",
        {"global_step": 3, STAMP_KEY: {"digest": "mine"}},
        age_s=60,
    )
    planted = _planted(folder / "checkpoints" / "last.ckpt", marker)  # the newest
    with caplog.at_level("WARNING"):
        assert resolve_checkpoint("auto", folder, "mine") == (str(good), 3)
    assert not marker.exists()
    (warning,) = [r.getMessage() for r in caplog.records if str(planted) in r.getMessage()]
    assert "holds objects other than tensors and plain values" in warning
    assert "not used, trying an older one" in warning and "\n" not in warning


def test_a_planted_checkpoint_named_by_ckpt_path_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "marker"
    planted = _planted(tmp_path / "received.ckpt", marker)
    with pytest.raises(ConfigError) as err:
        resolve_checkpoint(str(planted), tmp_path / "job", "mine")
    message = str(err.value)
    assert message.startswith(f"ckpt_path={planted}: {planted} holds objects other than")
    assert "drop ckpt_path" in message and "\n" not in message
    assert not marker.exists()


@pytest.mark.integration  # the command line, in a subprocess
def test_resuming_from_a_planted_checkpoint_runs_nothing_and_prints_no_traceback(tmp_path):
    marker = tmp_path / "marker"
    planted = _planted(tmp_path / "received.ckpt", marker)
    cmd = [sys.executable, "-m", "calm_lightning.run", *JOB, f"ckpt_path={planted}",
           f"hydra.run.dir={tmp_path / 'run'}"]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1
    assert f"error: ckpt_path={planted}: {planted} holds objects other than" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()


def test_training_resumes_through_trainer_fit_with_weights_only():
    from calm_lightning.methods.training import TrainingMethod

    seen = {}
    trainer = SimpleNamespace(fit=lambda module, **kwargs: seen.update(kwargs))
    TrainingMethod.calibrate(SimpleNamespace(), trainer, "datamodule", "last.ckpt")
    assert seen == {"datamodule": "datamodule", "ckpt_path": "last.ckpt", "weights_only": True}


@pytest.mark.integration
def test_the_projects_checkpoints_load_as_tensors_and_plain_values(tiny_calm_run):
    """Every checkpoint a CALM run writes: its history, the random generators' states, the
    loaders' positions, the optimizers, the stamp, all under weights_only=True."""
    files = sorted((tiny_calm_run / "checkpoints").glob("*.ckpt"))
    assert files
    for path in files:
        assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
        state = torch.load(path, weights_only=True, map_location="cpu")
        assert {"calm_history", "torch_rng_state", "loops", "optimizer_states"} <= set(state)
        assert state[STAMP_KEY]["digest"] and state["calm_history"]


# ----- a received run folder is data -----

PLANTED_MODULE = "planted_module_for_tests"


def _received(tiny_calm_run: Path, folder: Path, key: str, value) -> Path:
    """A copy of the tiny CALM run whose config says `key: value` (as someone could send)."""
    shutil.copytree(tiny_calm_run, folder)
    cfg = OmegaConf.load(folder / CONFIG_FILE)
    OmegaConf.update(cfg, key, value, force_add=True)
    OmegaConf.save(cfg, folder / CONFIG_FILE)  # an interpolation is saved as written
    return folder


RECEIVED = {
    "foreign_target": ("method.module._target_", f"{PLANTED_MODULE}.Payload"),
    "secret": ("model.name", "${oc.env:CALM_TEST_SECRET}"),
    "escaping_name": ("method.name", "../../escaped"),
}


@pytest.mark.integration
@pytest.mark.parametrize("case", sorted(RECEIVED))
def test_a_received_run_folder_imports_nothing_resolves_nothing_writes_nothing(
    case, tiny_calm_run, tmp_path, monkeypatch, capsys
):
    from calm_lightning.export import main as export_main
    from calm_lightning.retention import main as retention_main

    marker = tmp_path / "imported"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{PLANTED_MODULE}.py").write_text(
        f"open({str(marker)!r}, 'w')\nclass Payload:\n    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    monkeypatch.setenv("CALM_TEST_SECRET", "s3cr3t-token")
    key, value = RECEIVED[case]
    run = _received(tiny_calm_run, tmp_path / "received", key, value)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert export_main([f"run_dir={run}", f"out={tmp_path / 'export'}"]) == 1
    assert retention_main([f"run_dir={run}", "tasks=[piqa]"]) == 1
    errors = capsys.readouterr().err
    assert errors.count(f"{run / CONFIG_FILE}: {key}=") == 2 and "Traceback" not in errors
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert PLANTED_MODULE not in sys.modules and not marker.exists()
    assert "s3cr3t" not in errors
    for path in tmp_path.rglob("*"):
        assert not path.is_file() or b"s3cr3t" not in path.read_bytes(), path


@pytest.mark.integration
def test_the_models_hub_code_runs_only_when_the_command_line_says_so(
    tiny_calm_run, tmp_path, capsys
):
    from calm_lightning.export import main as export_main

    run = _received(tiny_calm_run, tmp_path / "received", "model.trust_remote_code", True)
    assert export_main([f"run_dir={run}", f"out={tmp_path / 'export'}"]) == 1
    error = capsys.readouterr().err
    assert "model.trust_remote_code=true" in error and "pass trust_remote_code=true" in error
    assert not (tmp_path / "export").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["received"]  # no staging left


@pytest.mark.integration
def test_overwrite_replaces_only_an_empty_folder_or_an_earlier_export(tiny_calm_run, tmp_path):
    from calm_lightning.exported.writer import export_run

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match=r"not an earlier export .*nothing was deleted"):
        export_run(tiny_calm_run, precious, overwrite=True)
    (tmp_path / "a_file").write_text("mine too")
    with pytest.raises(ExportError, match="is not a folder"):
        export_run(tiny_calm_run, tmp_path / "a_file", overwrite=True)
    assert (precious / "notes.txt").read_text() == "mine"
    assert (tmp_path / "a_file").read_text() == "mine too"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "precious"]
    empty = tmp_path / "empty"
    empty.mkdir()
    export_run(tiny_calm_run, empty, overwrite=True)
    assert (empty / "calibration.json").is_file()


@pytest.mark.integration
def test_a_fresh_runs_records_hold_no_absolute_path(tiny_calm_run):
    """metrics.json (its base-cache entries relative to the cache root) and retention.json
    (data files by name and hash)."""
    metrics = json.loads((tiny_calm_run / "metrics.json").read_text())
    assert metrics["base_cache"]["base"]["status"] == "computed"
    for name in ("metrics.json", "retention.json"):
        text = (tiny_calm_run / name).read_text()
        assert _absolute_strings(json.loads(text)) == [], name
        assert str(tiny_calm_run.parent) not in text and str(Path.home()) + "/" not in text
    files = json.loads((tiny_calm_run / "retention.json").read_text())["data_files"]
    piqa = ROOT / "tests" / "fixtures" / "hub" / "piqa.jsonl"
    import hashlib

    sha = hashlib.sha256(piqa.read_bytes()).hexdigest()
    assert files["piqa"] == [{"name": "piqa.jsonl", "sha256": sha}]


def _absolute_strings(node) -> list[str]:
    if isinstance(node, dict):
        return [s for value in node.values() for s in _absolute_strings(value)]
    if isinstance(node, list):
        return [s for value in node for s in _absolute_strings(value)]
    return [node] if isinstance(node, str) and os.path.isabs(node) else []


def test_the_export_guard_covers_the_default_cache_and_the_home_folder(tmp_path, monkeypatch):
    from calm_lightning.exported.private_paths import check_no_private_path, private_paths
    from calm_lightning.models.embedded import cache_root

    monkeypatch.delenv("CALM_LIGHTNING_CACHE", raising=False)
    run = SimpleNamespace(run_dir=tmp_path / "run", cfg=OmegaConf.create({"seed": 0}))
    paths = private_paths(run)
    folder = tmp_path / "export"
    folder.mkdir()
    for leaked in (f"{cache_root()}/models/x", f"{Path.home()}/data/train.jsonl"):
        (folder / "README.md").write_text(f"trained on {leaked}\n")
        with pytest.raises(ExportError, match="would hold the local path"):
            check_no_private_path(folder, paths)
    (folder / "README.md").write_text("trained on train.jsonl\n")
    check_no_private_path(folder, paths)


# ----- shared folders -----


def _foreign_group() -> int | None:
    """A group this process may give its folder that is not its user's private group."""
    import grp

    from calm_lightning.runtime.job_state import _private_group

    candidates = [g.gr_gid for g in grp.getgrall()] if os.getuid() == 0 else os.getgroups()
    return next((gid for gid in candidates if not _private_group(gid)), None)


@pytest.fixture
def group_sweep(tmp_path) -> Path:
    """A folder of this user, writable by a group with other members (rwxrwxr-x)."""
    gid = _foreign_group()
    if gid is None:
        pytest.skip("no group other than this user's private one")
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    os.chown(sweep, -1, gid)
    sweep.chmod(stat.S_IRWXU | stat.S_IRWXG | stat.S_IROTH | stat.S_IXOTH)
    return sweep


def test_a_group_or_world_writable_folder_is_refused_unless_allowed(
    compose, tmp_path, group_sweep, caplog
):
    sweep = group_sweep
    job = tmp_path / "job"  # the base cache of this job goes to the shared folder
    job.mkdir()
    cfg = compose([*JOB, f"evaluation.base_cache_dir={sweep}"], job)
    with pytest.raises(ConfigError, match=r"is writable by the group .*allow_shared_folder=true"):
        JobFolder(cfg).check_identity()
    job.chmod(0o777)
    with pytest.raises(ConfigError, match=f"{job} is writable by every user"):
        JobFolder(compose(JOB, job)).check_identity()
    assert list(job.iterdir()) == [] and list(sweep.iterdir()) == []
    allowed = [*JOB, f"evaluation.base_cache_dir={sweep}", "allow_shared_folder=true"]
    with caplog.at_level("WARNING"):
        JobFolder(compose(allowed, job)).check_identity()
    assert any("allow_shared_folder=true" in r.getMessage() for r in caplog.records)


@pytest.mark.integration  # the command line, in a subprocess
def test_a_sweep_into_a_group_writable_folder_is_refused(group_sweep):
    sweep = group_sweep
    cmd = [sys.executable, "-m", "calm_lightning.run", "-m", *JOB, f"hydra.sweep.dir={sweep}"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 1
    assert f"error: {sweep} is writable by the group" in done.stderr
    assert "Traceback" not in done.stderr
    assert not list(sweep.rglob("*.ckpt")) and not list(sweep.rglob("metrics.json"))


def test_a_lock_file_that_cannot_be_opened_counts_as_held(compose, tmp_path):
    (tmp_path / "elsewhere").write_text("")
    (tmp_path / JOB_LOCK_FILE).symlink_to(tmp_path / "elsewhere")  # never followed
    lock = FileLock(tmp_path / JOB_LOCK_FILE)
    assert not lock.acquire(blocking=False)
    assert not lock.unavailable and "a symbolic link" in lock.denied
    with pytest.raises(ConfigError, match=f"{JOB_LOCK_FILE} cannot be opened .*not started"):
        JobFolder(compose(JOB, tmp_path)).acquire()


def test_another_users_lock_file_still_locks(tmp_path, monkeypatch):
    """Opened read-only where it may not be written (another user's, default umask): flock
    still excludes, where the job used to run unlocked."""
    path = tmp_path / JOB_LOCK_FILE
    mine = FileLock(path)
    assert mine.acquire(blocking=False)
    real_open = os.open

    def not_writable(name, flags, *args):  # as another user sees a 0644 file of ours
        if str(name) == str(path) and flags & (os.O_RDWR | os.O_WRONLY):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return real_open(name, flags, *args)

    def not_writable_file(name, mode="r", *args, **kwargs):  # the same through builtins.open
        if str(name) == str(path) and set(mode) & set("aw+"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
        return open(name, mode, *args, **kwargs)

    monkeypatch.setattr(file_lock.os, "open", not_writable)
    monkeypatch.setattr(file_lock, "open", not_writable_file, raising=False)
    theirs = FileLock(path)
    assert not theirs.acquire(blocking=False) and not theirs.unavailable
    mine.release()
    assert theirs.acquire(blocking=False)
    theirs.release()


# ----- the lock's lease fallback (filesystems without flock) -----


def _no_flock(handle, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # Lustre mounted with noflock


def _dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_non_blocking_acquire_takes_a_dead_holders_lease_at_once(tmp_path, monkeypatch):
    """Defect 1: the stale lease was removed and the acquire still said "held"."""
    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    lock = FileLock(tmp_path / JOB_LOCK_FILE)
    lock.owner_file.write_text(f"{socket.gethostname()} {_dead_pid()}\n")
    assert lock.acquire(blocking=False)
    assert lock.owner_file.read_text().split()[:2] == [socket.gethostname(), str(os.getpid())]
    lock.release()
    assert not lock.owner_file.exists()


def test_a_job_killed_on_a_filesystem_without_flock_gets_its_failed_json(tmp_path, monkeypatch):
    """Defect 1 as a sweep sees it: the supervisor of a killed job records its failure."""
    from calm_lightning.runtime.job_process import record_lost_job

    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    owner = FileLock(tmp_path / JOB_LOCK_FILE).owner_file
    owner.write_text(f"{socket.gethostname()} {_dead_pid()}\n")  # the killed job's lease
    record_lost_job(tmp_path, -9)
    assert "killed" in json.loads((tmp_path / FAILED_FILE).read_text())["error"]
    assert not owner.exists()


def test_a_takeover_never_removes_a_newer_holders_lease(tmp_path, monkeypatch):
    """Defect 2: between judging a lease stale and removing it, another process took it over
    and made its own; the path-based removal deleted that one."""
    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    path = tmp_path / "entry.lock"
    stale = FileLock(path).owner_file
    stale.write_text("some-other-node 1\n")
    old = time.time() - file_lock.LEASE_STALE_S - 1
    os.utime(stale, (old, old))
    newer, real = FileLock(path), file_lock._stale_reason

    def judged_then_overtaken(*args):
        why = real(*args)
        if why and not newer.held:  # another contender acts right after this judgement
            monkeypatch.setattr(file_lock, "_stale_reason", real)
            assert newer.acquire(timeout=2)
            monkeypatch.setattr(file_lock, "_stale_reason", judged_then_overtaken)
        return why

    monkeypatch.setattr(file_lock, "_stale_reason", judged_then_overtaken)
    assert not FileLock(path).acquire(blocking=False)
    monkeypatch.setattr(file_lock, "_stale_reason", real)
    assert newer.held and newer.owner_file.read_text().split()[1] == str(os.getpid())
    assert not FileLock(path).acquire(blocking=False)
    newer.release()
    assert not newer.owner_file.exists()


def test_release_leaves_a_lease_taken_over_meanwhile(tmp_path, monkeypatch, caplog):
    """Defect 3: a holder whose lease went stale (it stopped renewing: paused, swapped out)
    removed its successor's lease on release."""
    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    path = tmp_path / "entry.lock"
    first = FileLock(path)
    assert first.acquire(blocking=False)
    old = time.time() - file_lock.LEASE_STALE_S - 1
    os.utime(first.owner_file, (old, old))
    second = FileLock(path)
    assert second.acquire(timeout=2)
    with caplog.at_level("WARNING"):
        first.release()
    assert any("taken over by another" in r.getMessage() for r in caplog.records)
    assert second.owner_file.exists() and not FileLock(path).acquire(blocking=False)
    second.release()
    assert not second.owner_file.exists()


# ----- small atomic-write fixes -----


def test_a_checkpoint_is_written_beside_its_target_and_fsynced_before_the_rename(
    tmp_path, monkeypatch
):
    from calm_lightning.runtime import run_record
    from calm_lightning.runtime.checkpointing import AtomicCheckpointIO

    events, real_fsync, real_replace, real_save = [], os.fsync, os.replace, torch.save
    monkeypatch.setattr(run_record.os, "fsync", lambda fd: events.append("fsync") or real_fsync(fd))
    monkeypatch.setattr(
        run_record.os, "replace", lambda a, b: events.append(("replace", a)) or real_replace(a, b)
    )
    monkeypatch.setattr(
        torch, "save", lambda obj, f, **kw: events.append(("save", f)) or real_save(obj, f, **kw)
    )
    target = tmp_path / "checkpoints" / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 4, "w": torch.ones(3)}, target)
    (save,) = [e for e in events if e[0] == "save"]
    assert Path(save[1].name).parent == target.parent  # straight into a file beside it
    assert events.index("fsync") < next(i for i, e in enumerate(events) if e[0] == "replace")
    assert torch.load(target, weights_only=True)["global_step"] == 4
    assert [p.name for p in target.parent.iterdir()] == ["last.ckpt"]


def test_the_embedded_cache_is_replaced_without_a_half_deleted_folder(tmp_path, monkeypatch):
    from calm_lightning.models import embedded

    target = tmp_path / "models" / "smollm2"

    def write(version):
        return lambda folder: (folder / "weights").write_text(version)

    embedded._write_atomically(target, {"v": 1}, write("old"))
    seen = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):  # what a reader finds at `target` while a folder goes
        seen.append((target / "weights").read_text() if target.exists() else None)
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(embedded.shutil, "rmtree", rmtree)
    embedded._write_atomically(target, {"v": 2}, write("new"))
    assert seen and set(seen) == {"new"}  # the old folder is deleted only once the new is in
    assert (target / "weights").read_text() == "new"
    assert sorted(p.name for p in target.parent.iterdir()) == ["smollm2"]
