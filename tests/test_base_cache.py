"""The base row computed once per sweep: what the fingerprint holds, one computation among
concurrent jobs, and runs that read their base row equal to runs that score it, byte for byte."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from calm_lightning.data.sources import EmbeddedDemoSource
from calm_lightning.evaluation.base_cache import BaseCache, Fingerprint, base_fingerprint
from calm_lightning.methods.base import method_class
from calm_lightning.pipeline import run_experiment
from calm_lightning.runtime import file_lock
from calm_lightning.runtime.run_record import BASE_CACHE_DIR, BASE_DIR, METRICS_FILE

TINY_CALM = [
    "model=tiny",
    "method=calm",
    "peft.r=4",
    "setting=demo",
    "setting.test.limit=8",
    "setting.eval_batch_size=8",
    "trainer.limit_train_batches=1",
    "method.module.inner_steps=1",
    "trainer.enable_progress_bar=false",
    "logger=none",
]
CPU_TRAINER = SimpleNamespace(
    strategy=SimpleNamespace(root_device=torch.device("cpu")), precision="32-true", world_size=1
)


def _fingerprint(compose, overrides, limit=8) -> Fingerprint:
    cfg = compose([*TINY_CALM, *overrides], "/tmp/unused")
    records = EmbeddedDemoSource("mcqa", "test", limit=limit).load()
    return base_fingerprint(cfg, method_class(cfg), records, CPU_TRAINER)


def test_fingerprint_follows_what_the_base_row_depends_on(compose):
    same = _fingerprint(compose, ["method.module.upper_lr=0.5", "method.module.lower_lr=0.1"])
    reference = _fingerprint(compose, [])
    assert same.digest == reference.digest  # training settings do not change the base row
    assert reference.inputs["test"]["ids"] == [
        r.id for r in EmbeddedDemoSource("mcqa", "test", limit=8).load()
    ]
    changed = {
        "test limit": _fingerprint(compose, [], limit=7),
        "model dtype": _fingerprint(compose, ["model.dtype=bfloat16"]),
        "logit scale": _fingerprint(compose, ["model.logit_scale=4.0"]),
        "option tokens": _fingerprint(compose, ["evaluation.option_tokens=space"]),
        "scoring": _fingerprint(compose, ["evaluation.scoring=cloze"]),
        "normalisation": _fingerprint(compose, ["evaluation.cloze.normalize=chars"]),
        "bins": _fingerprint(compose, ["evaluation.n_bins=15"]),
        "head": _fingerprint(compose, ["method.head.center=logsumexp"]),
        "batches": _fingerprint(compose, ["setting.eval_batch_size=4"]),
    }
    for what, fingerprint in changed.items():
        assert fingerprint.digest != reference.digest, what
    # Multiple-choice scoring never samples: the seed (and the open-QA block it feeds) does
    # not enter; open-QA test data samples with it, so there it does.
    assert _fingerprint(compose, ["seed=1", "evaluation.openqa.seed=3"]).digest == reference.digest
    cfg = compose(TINY_CALM, "/tmp/unused")
    questions = EmbeddedDemoSource("openqa", "test", limit=4).load()
    sampled = {
        seed: base_fingerprint(
            compose([*TINY_CALM, f"evaluation.openqa.seed={seed}"], "/tmp/unused"),
            method_class(cfg),
            questions,
            CPU_TRAINER,
        ).digest
        for seed in (0, 3)
    }
    assert sampled[0] != sampled[3]
    # A changed record under the same id misses too (a hash of the content, not only the ids).
    from dataclasses import replace

    records = EmbeddedDemoSource("mcqa", "test", limit=8).load()
    edited = [replace(records[0], answer=(records[0].answer + 1) % 4), *records[1:]]
    cfg = compose(TINY_CALM, "/tmp/unused")
    moved = base_fingerprint(cfg, method_class(cfg), edited, CPU_TRAINER)
    assert moved.inputs["test"]["ids"] == reference.inputs["test"]["ids"]
    assert moved.digest != reference.digest


def test_fingerprint_holds_the_resolved_quantization_dtype_and_device(compose, monkeypatch):
    from calm_lightning.models import loading

    cpu = _fingerprint(compose, [])
    assert cpu.inputs["model"]["resolved"] == {
        "dtype": "float32", "quantization": "none", "revision": None,
    }  # fmt: skip
    assert cpu.inputs["numerics"]["device_name"] == "cpu"
    # `auto` on a GPU: nf4 with bitsandbytes, plain LoRA without: the same config, two rows.
    shape = {"source": "tiny", "shape": "small", "quantization": "auto", "dtype": "auto"}
    monkeypatch.setattr(loading, "cuda_available", lambda: True)
    monkeypatch.setattr(loading, "_bitsandbytes_installed", lambda: True)
    with_bnb = loading.resolved_choices({**shape, "source": "hub", "local_path": "/m"})
    assert loading.resolved_choices(shape)["quantization"] == "nf4"  # a random shape
    monkeypatch.setattr(loading, "_bitsandbytes_installed", lambda: False)
    without = loading.resolved_choices({**shape, "source": "hub", "local_path": "/m"})
    assert (with_bnb["quantization"], without["quantization"]) == ("nf4", "none")
    assert with_bnb["dtype"] == without["dtype"] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    gpu = SimpleNamespace(**{**vars(CPU_TRAINER), "strategy": SimpleNamespace(
        root_device=torch.device("cuda", 1))})  # fmt: skip
    cfg = compose(TINY_CALM, "/tmp/unused")
    records = EmbeddedDemoSource("mcqa", "test", limit=8).load()
    numerics = base_fingerprint(cfg, method_class(cfg), records, gpu).inputs["numerics"]
    assert numerics["device"] == "cuda" and numerics["device_name"] == "NVIDIA H200"


def test_a_moving_hub_revision_resolves_to_the_commit_read(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from calm_lightning.models.loading import resolved_choices

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--model"
    for commit in ("a" * 40, "b" * 40):
        (repo / "snapshots" / commit).mkdir(parents=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    hub = {"source": "hub", "model_id": "org/model", "quantization": "none", "revision": None}
    (repo / "refs" / "main").write_text("a" * 40)
    assert resolved_choices(hub)["revision"] == "a" * 40
    (repo / "refs" / "main").write_text("b" * 40)  # main moved: another fingerprint
    assert resolved_choices(hub)["revision"] == "b" * 40
    assert resolved_choices({**hub, "revision": "a" * 40})["revision"] == "a" * 40
    assert resolved_choices({**hub, "local_path": str(tmp_path)})["revision"] is None


def test_the_retention_fingerprint_holds_its_precision(compose, monkeypatch):
    from calm_lightning.evaluation.base_cache import retention_fingerprint
    from calm_lightning.evaluation.lm_eval_tasks import RetentionSettings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the same on any machine

    settings = RetentionSettings(tasks=("piqa",))
    prints = {
        dtype: retention_fingerprint(cfg, method_class(cfg), settings)
        for dtype in ("float32", "bfloat16")
        for cfg in [compose([*TINY_CALM, "model=random", f"model.dtype={dtype}"], "/tmp/unused")]
    }
    assert prints["bfloat16"].inputs["numerics"] == {
        "device": "cpu", "device_name": "cpu", "dtype": "bfloat16", "quantization": "none",
    }  # fmt: skip
    assert prints["float32"].digest != prints["bfloat16"].digest


def _job(root: str, log: str, index: int, barrier) -> None:
    """One concurrent job: compute (slowly, appending to `log`) unless another job did."""
    cache = BaseCache(Path(root))
    fingerprint = Fingerprint("base", {"what": "shared"})

    def compute() -> dict:
        with open(log, "a") as handle:
            handle.write(f"{index}\n")
        time.sleep(0.5)
        return {"value": index}

    barrier.wait()
    payload, record = cache.fetch(fingerprint, compute)
    Path(root, f"job{index}.json").write_text(json.dumps([payload, record["status"]]))


def _no_flock(handle, operation):
    raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # Lustre mounted with noflock


@pytest.mark.parametrize("locking", ["flock", "no flock"])
def test_concurrent_jobs_compute_once_and_the_others_read(tmp_path, monkeypatch, locking):
    if locking == "no flock":  # the forked jobs inherit the patch: the O_EXCL lock file
        monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(4)
    log = tmp_path / "computed.txt"
    jobs = [
        context.Process(target=_job, args=(str(tmp_path / "cache"), str(log), i, barrier))
        for i in range(4)
    ]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(30)
        assert job.exitcode == 0
    (computer,) = [int(line) for line in log.read_text().split()]  # exactly one computation
    results = [json.loads((tmp_path / "cache" / f"job{i}.json").read_text()) for i in range(4)]
    assert all(payload == {"value": computer} for payload, _ in results)
    statuses = sorted(status for _, status in results)
    assert statuses == ["computed", "read", "read", "read"]
    assert not [
        p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".base-") and p.is_dir()
    ]


def test_without_any_lock_a_job_warns_once_and_still_computes_and_stores(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    monkeypatch.setattr(file_lock, "_warned", set())

    real_open = os.open

    def no_lock_file(path, flags, *args):  # no lock file can be made here; entries can
        if str(path).endswith(".owner"):  # (a folder one may not write counts as held instead)
            raise OSError(errno.EROFS, "no lock file here")
        return real_open(path, flags, *args)

    monkeypatch.setattr(file_lock.os, "open", no_lock_file)
    cache = BaseCache(tmp_path)
    with caplog.at_level("WARNING"):
        first = cache.fetch(Fingerprint("base", {"what": 1}), lambda: {"value": 1})
        second = cache.fetch(Fingerprint("base", {"what": 1}), lambda: {"value": 2})
    assert first == ({"value": 1}, {**first[1], "status": "computed"})
    assert second[0] == {"value": 1} and second[1]["status"] == "read"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert sum("flock is not supported" in w for w in warnings) == 1
    assert sum("no lock can be taken" in w for w in warnings) == 1
    assert sum("going on without it" in w for w in warnings) == 1


def test_a_lock_file_left_by_a_dead_process_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    dead = multiprocessing.get_context("fork").Process(target=lambda: None)
    dead.start()
    dead.join()
    lock = file_lock.FileLock(tmp_path / "entry.lock")
    lock.owner_file.write_text(f"{socket.gethostname()} {dead.pid}\n")
    assert lock.acquire(timeout=5) and lock.held
    other = file_lock.FileLock(tmp_path / "entry.lock")
    assert not other.acquire(blocking=False)  # alive owner (this process): held
    lock.release()
    assert not lock.owner_file.exists() and other.acquire(blocking=False)
    other.release()
    # another host's owner cannot be checked: held while it renews its lease ...
    lock.owner_file.write_text("some-other-node 1\n")
    assert not lock.acquire(timeout=0.3)
    # ... and stale once it has not for LEASE_STALE_S (a dead node), on any host
    old = time.time() - file_lock.LEASE_STALE_S - 1
    os.utime(lock.owner_file, (old, old))
    assert lock.acquire(timeout=1) and lock.held
    lock.release()
    # an empty owner file (its writer died before writing) is stale after a short grace
    lock.owner_file.write_text("")
    assert not lock.acquire(blocking=False)
    old = time.time() - file_lock.EMPTY_GRACE_S - 1
    os.utime(lock.owner_file, (old, old))
    assert lock.acquire(timeout=1)
    lock.release()
    # a folder where no lock file can even be opened: no lock, no crash
    (tmp_path / "a_file").write_text("")
    nowhere = file_lock.FileLock(tmp_path / "a_file" / "entry.lock")
    assert not nowhere.acquire() and nowhere.unavailable


def test_the_owner_renews_its_lease_while_it_holds_the_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(file_lock.fcntl, "flock", _no_flock)
    monkeypatch.setattr(file_lock, "LEASE_REFRESH_S", 0.05)
    lock = file_lock.FileLock(tmp_path / "entry.lock")
    assert lock.acquire(blocking=False)
    old = time.time() - 1000
    os.utime(lock.owner_file, (old, old))
    time.sleep(0.3)
    assert time.time() - lock.owner_file.stat().st_mtime < 5  # touched again
    lock.release()
    assert not lock.owner_file.exists()


def test_an_entry_holding_a_symbolic_link_is_never_read_or_copied(tmp_path, caplog):
    """A writer of a shared cache folder could link an entry's file to one of the reader's
    (a key, a token): such an entry is not used, and restoring never copies through a link."""
    cache, fingerprint = BaseCache(tmp_path / "cache"), Fingerprint("base", {"what": 1})
    files = tmp_path / "files"
    files.mkdir()
    (files / "predictions.jsonl").write_text('{"id": 1}\n')
    cache.fetch(fingerprint, lambda: {"value": 1}, files)
    entry = cache.root / fingerprint.entry_name
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    (entry / "predictions.jsonl").unlink()
    (entry / "predictions.jsonl").symlink_to(secret)
    with caplog.at_level("WARNING"):
        payload, record = cache.fetch(fingerprint, lambda: {"value": "recomputed"})
    assert record["status"] == "computed" and payload == {"value": "recomputed"}
    assert any("symbolic link" in r.getMessage() for r in caplog.records)
    restored = tmp_path / "run" / "base"
    BaseCache.restore(entry, restored)
    assert not (restored / "predictions.jsonl").exists()


def test_a_mismatched_entry_is_never_used(tmp_path):
    cache = BaseCache(tmp_path)
    fingerprint = Fingerprint("base", {"what": 1})
    cache.fetch(fingerprint, lambda: {"value": 1})
    # An entry under the same name whose stored fingerprint is another's (a forged or
    # truncated-digest clash) is computed again, not read.
    entry = tmp_path / fingerprint.entry_name / "cache_entry.json"
    stored = json.loads(entry.read_text())
    entry.write_text(json.dumps({**stored, "inputs": {"what": 2}}))
    payload, record = cache.fetch(fingerprint, lambda: {"value": "recomputed"})
    assert record["status"] == "computed" and payload == {"value": "recomputed"}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.integration
def test_jobs_read_the_base_row_and_match_an_uncached_run(tmp_path, compose):
    shared = [*TINY_CALM, f"evaluation.base_cache_dir={tmp_path / 'sweep'}"]
    records = {}
    for name, extra in {
        "first": ["method.module.upper_lr=0.01"],
        "second": ["method.module.upper_lr=0.05"],
        "uncached": ["method.module.upper_lr=0.05", "evaluation.base_cache=false"],
    }.items():
        run_experiment(compose([*shared, *extra], tmp_path / name))
        records[name] = json.loads((tmp_path / name / METRICS_FILE).read_text())
    first, second = records["first"]["base_cache"]["base"], records["second"]["base_cache"]["base"]
    assert first["status"] == "computed" and second["status"] == "read"
    assert first["fingerprint"] == second["fingerprint"]
    assert records["uncached"]["base_cache"]["base"]["status"] == "off"
    # The run that read its base row is the uncached run, byte for byte: the base folder,
    # every compared row, the method's predictions.
    assert _files(tmp_path / "second" / BASE_DIR) == _files(tmp_path / "uncached" / BASE_DIR)
    assert json.dumps(records["second"]["comparison"]) == json.dumps(
        records["uncached"]["comparison"]
    )
    assert (tmp_path / "second" / "predictions.jsonl").read_bytes() == (
        tmp_path / "uncached" / "predictions.jsonl"
    ).read_bytes()


@pytest.mark.slow
def test_multirun_of_three_jobs_evaluates_the_base_once(tmp_path):
    """The command line: `--multirun method.module.upper_lr=a,b,c` with the sweep's own cache."""
    import os
    import subprocess
    import sys

    args = [
        sys.executable,
        "-m",
        "calm_lightning.run",
        "--multirun",
        *TINY_CALM,
        "method.module.upper_lr=0.01,0.05,0.1",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted((tmp_path / "sweep").glob("[0-9]_*"))
    assert len(jobs) == 3
    cached = [json.loads((j / METRICS_FILE).read_text())["base_cache"]["base"] for j in jobs]
    assert [c["status"] for c in cached] == ["computed", "read", "read"]
    assert len({c["fingerprint"] for c in cached}) == 1
    # named relative to the cache root (metrics.json is shareable), and found there
    assert "/" not in cached[0]["entry"]
    assert (tmp_path / "sweep" / BASE_CACHE_DIR / cached[0]["entry"]).is_dir()
    # Another test limit, reading the same cache: another fingerprint, computed.
    args[-1] = f"hydra.sweep.dir={tmp_path / 'other'}"
    args[args.index("method.module.upper_lr=0.01,0.05,0.1")] = "method.module.upper_lr=0.05"
    args += ["setting.test.limit=6", f"evaluation.base_cache_dir={tmp_path / 'sweep'}"]
    done = subprocess.run(args, capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (job,) = (tmp_path / "other").glob("[0-9]_*")
    other = json.loads((job / METRICS_FILE).read_text())
    assert other["base_cache"]["base"]["status"] == "computed"
    assert other["base_cache"]["base"]["fingerprint"] != cached[0]["fingerprint"]
    assert other["comparison"]["base"]["n"] == 6
    assert len([p for p in (tmp_path / "sweep" / BASE_CACHE_DIR).iterdir() if p.is_dir()]) == 2


@pytest.mark.integration
def test_the_base_retention_row_is_read_by_the_next_job(tmp_path, compose):
    pytest.importorskip("lm_eval")
    hub = Path(__file__).parent / "fixtures" / "hub"
    overrides = [
        "model=tiny",
        "method=base",
        "setting.test.limit=4",
        "logger=none",
        "trainer.enable_progress_bar=false",
        "evaluation.retention.tasks=[arc_challenge]",
        f"evaluation.retention.data_files.arc_challenge=[{hub / 'arc_challenge.jsonl'}]",
        "evaluation.retention.limit=3",
        f"evaluation.base_cache_dir={tmp_path / 'sweep'}",
    ]
    for name in ("first", "second"):
        run_experiment(compose(overrides, tmp_path / name))
    cached = [
        json.loads((tmp_path / n / METRICS_FILE).read_text())["base_cache"]["retention_base"]
        for n in ("first", "second")
    ]
    assert [c["status"] for c in cached] == ["computed", "read"]
    assert cached[0]["fingerprint"] == cached[1]["fingerprint"]
    rows = [json.loads((tmp_path / n / "retention.json").read_text()) for n in ("first", "second")]
    assert rows[0]["rows"] == rows[1]["rows"] and rows[0]["rows"]["base"]["arc_challenge"]["n"] == 3
    samples = [_files(tmp_path / n / "retention" / "base") for n in ("first", "second")]
    assert samples[0] == samples[1] and samples[0]
