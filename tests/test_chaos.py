"""A sweep that is killed (SIGKILL to the whole process group) at random moments and at the
risky ones, and relaunched with the same command until it is done, ends with every job's
metrics equal to an uninterrupted sweep's; nothing is lost, restarted from zero after a
checkpoint, or left half-written, and a last relaunch rewrites nothing.

The system tier (`make test-system`, which CI runs after `make check`; run it before merging
anything under runtime/, methods/training.py or data/resumable.py): a few minutes on 2 cores.
By hand: `pytest -m system tests/test_chaos.py -s`; CHAOS_SEED picks another kill schedule.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[1]
JOBS = 4
RANDOM_KILLS = 8
SWEEP = [
    "model=tiny",
    "method=calm",
    "peft.r=4",
    "setting.test.limit=8",
    "trainer.limit_train_batches=4",
    "trainer.max_epochs=2",
    "method.module.inner_steps=1",
    "callbacks.periodic.every_n_train_steps=1",
    "logger=none",
    "trainer.enable_progress_bar=false",
    "method.module.upper_lr=0.01,0.05",
    "method.module.surrogate.schedule=per_step,amortized",
]
# Files of the run record; Hydra's own (.hydra/, the job's log) are the launcher's to rewrite.
RECORD = re.compile(r"(metrics\.json|predictions\.jsonl|job\.json|attempts\.jsonl|"
                    r"config_resolved\.yaml|\.ckpt|cache_entry\.json)$")  # fmt: skip


class SigkillOnce(L.Callback):
    """SIGKILLs its own process the first time `moment` comes (a marker file remembers; jobs
    running at once race for it, and one wins)."""

    def __init__(self, moment: str, marker: str) -> None:
        self.moment, self.marker = moment, Path(marker)

    def _die(self) -> None:
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        os.kill(os.getpid(), signal.SIGKILL)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if self.moment == "save" and trainer.global_step >= 3:
            self._die()

    def on_test_start(self, trainer, pl_module) -> None:
        # no base row yet: this pass scores the untouched model, holding the base-cache lock
        if self.moment == "base" and not self._base_row(trainer).is_file():
            self._die()

    def on_test_end(self, trainer, pl_module) -> None:
        # the base row exists: the method's pass has ended, its row not yet written
        if self.moment == "method_scored" and self._base_row(trainer).is_file():
            self._die()

    @staticmethod
    def _base_row(trainer) -> Path:
        return Path(trainer.default_root_dir) / "base" / "metrics.json"


def _launch(sweep_dir: Path, *extra: str, grid: bool = True) -> subprocess.Popen:
    base = SWEEP if grid else [o for o in SWEEP if "," not in o]
    cmd = [sys.executable, "-m", "calm_lightning.run", "-m", *base, *extra,
           f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, timeout: float = 600) -> int:
    _, err = proc.communicate(timeout=timeout)
    if proc.returncode not in (0, -signal.SIGKILL):
        print(err[-3000:])
    return proc.returncode


def _metrics(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/metrics.json")}


def _checkpointed_step(job: Path) -> int:
    steps = [int(m.group(1)) for p in (job / "checkpoints").glob("*.ckpt")
             if (m := re.search(r"step[=-](\d+)", p.name))]  # fmt: skip
    return max(steps, default=0)


def _jobs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.glob("*_tiny_*") if p.is_dir())


def _attempts(job: Path) -> list[dict]:
    path = job / "attempts.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line) for line in lines if line.strip()]


def _record_state(sweep_dir: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in sweep_dir.rglob("*")
            if p.is_file() and RECORD.search(p.name)}  # fmt: skip


def test_a_sweep_killed_anywhere_and_relaunched_ends_as_an_uninterrupted_one(tmp_path):
    reference = tmp_path / "reference"
    assert _finish(_launch(reference)) == 0
    expected = _metrics(reference)
    assert len(expected) == JOBS

    chaos, rng = tmp_path / "chaos", random.Random(int(os.environ.get("CHAOS_SEED", "0")))
    killed, launches = [], 0
    # the risky moments first, each once (marker files), then random SIGKILLs of the group
    for moment in ("base", "save", "method_scored"):
        marker = tmp_path / f"{moment}.marker"
        kill = [
            "+callbacks.chaos._target_=tests.test_chaos.SigkillOnce",
            f"+callbacks.chaos.moment={moment}",
            f"+callbacks.chaos.marker={marker}",
        ]
        launches += 1
        _finish(_launch(chaos, *kill))
        assert marker.exists(), moment
    while len(_metrics(chaos)) < JOBS:
        launches += 1
        assert launches < 30, "the sweep does not finish"
        before = {job.name: (_checkpointed_step(job), len(_attempts(job))) for job in _jobs(chaos)}
        proc = _launch(chaos)
        try:
            # at most RANDOM_KILLS random kills, then the sweep runs to its end: on a loaded
            # machine a launch may get little done between kills
            proc.wait(timeout=rng.uniform(4, 20) if len(killed) < RANDOM_KILLS else 600)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            killed.append(before)
        _finish(proc)
        for job in _jobs(chaos):  # no start went back behind a checkpoint the job had
            step, seen = before.get(job.name, (0, 0))
            assert all(a["start_step"] >= step for a in _attempts(job)[seen:]), job.name
    assert killed, "no random kill happened: lower the delays"

    got = _metrics(chaos)
    assert got.keys() == expected.keys()
    for name, summary in got.items():
        for key in ("accuracy", "conf_ece", "nll", "brier"):
            want = expected[name]["metrics"][key]
            assert summary["metrics"][key] == pytest.approx(want, rel=1e-4, abs=1e-4), (name, key)
        assert summary["attempts"][0]["reason"] == "fresh"
        assert all(a["reason"] in ("fresh", "resume") for a in summary["attempts"])
    assert not list(chaos.rglob("failed.json"))
    strays = [p for p in chaos.rglob(".*") if p.name != ".job.lock"
              and ".hydra" not in p.parts and not p.name.endswith(".lock")
              and not p.name.endswith(".owner")]  # fmt: skip
    assert not strays, strays

    state = _record_state(chaos)
    started = time.monotonic()
    assert _finish(_launch(chaos)) == 0
    assert _record_state(chaos) == state  # the finished sweep is read, not rerun
    print(f"{launches} launches, {len(killed)} random kills; "
          f"relaunch of the finished sweep: {time.monotonic() - started:.0f} s")  # fmt: skip


class SlowSteps(L.Callback):
    """Makes every training step last `seconds` longer (a job that outlives its time limit)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(self.seconds)


def test_a_job_longer_than_its_time_limit_is_requeued_by_submitit_and_finishes(tmp_path):
    """submitit's local executor runs the cluster path: at timeout minus its signal delay
    (30 s) it signals the job, which saves a checkpoint after its step and is requeued through
    the launcher's checkpoint(); the next attempt resumes from that step."""
    sweep = tmp_path / "sweep"
    proc = _launch(
        sweep,
        "hydra/launcher=submitit_local",
        "hydra.launcher.timeout_min=1",
        "trainer.limit_train_batches=15",  # 30 steps of 2 s: twice what one minute allows
        "+callbacks.slow._target_=tests.test_chaos.SlowSteps",
        "+callbacks.slow.seconds=2",
        "method.module.upper_lr=0.05",
        "method.module.surrogate.schedule=per_step",
        grid=False,
    )
    assert _finish(proc, timeout=900) == 0
    (job,) = _jobs(sweep)
    summary = json.loads((job / "metrics.json").read_text())
    attempts = summary["attempts"]
    assert len(attempts) >= 2, attempts
    assert attempts[0] == {**attempts[0], "reason": "fresh", "start_step": 0}
    assert all(a["reason"] == "requeue" and a["start_step"] > 0 for a in attempts[1:]), attempts
    assert not list(sweep.rglob("failed.json"))


def test_a_parallel_sweep_outlives_a_killed_job_and_a_relaunch_reruns_only_it(tmp_path):
    """hydra/launcher=parallel, 3 jobs 2 at a time: one job's process is SIGKILLed inside a
    checkpoint save (as the out-of-memory killer would); the other two finish, the sweep ends
    normally with that job's failed.json, and the same command again reruns that job alone,
    from its checkpoint. (Before, joblib's loky pool broke and the whole sweep stopped.)"""
    sweep, marker = tmp_path / "sweep", tmp_path / "save.marker"
    command = [
        "hydra/launcher=parallel",
        "hydra.launcher.n_jobs=2",
        "trainer=parallel_job",
        "method.module.surrogate.schedule=per_step",
        "method.module.upper_lr=0.01,0.05,0.1",
        "+callbacks.chaos._target_=tests.test_chaos.SigkillOnce",
        "+callbacks.chaos.moment=save",
        f"+callbacks.chaos.marker={marker}",  # one job dies, once: the marker remembers
    ]
    started = time.monotonic()
    assert _finish(_launch(sweep, *command, grid=False)) == 0
    first = time.monotonic() - started
    assert marker.exists()
    jobs = _jobs(sweep)
    assert len(jobs) == 3
    (killed,) = [job for job in jobs if (job / "failed.json").is_file()]
    error = json.loads((killed / "failed.json").read_text())["error"]
    assert "killed by SIGKILL" in error and "relaunch the same command" in error, error
    assert not (killed / "metrics.json").exists()
    finished = [job for job in jobs if job != killed]
    assert all((job / "metrics.json").is_file() for job in finished)
    kept = {p: t for p, t in _record_state(sweep).items() if killed.name not in p}

    started = time.monotonic()
    assert _finish(_launch(sweep, *command, grid=False)) == 0
    relaunch = time.monotonic() - started
    assert all((job / "metrics.json").is_file() for job in jobs)
    assert not list(sweep.rglob("failed.json"))
    assert {p: t for p, t in _record_state(sweep).items() if killed.name not in p} == kept
    attempts = json.loads((killed / "metrics.json").read_text())["attempts"]
    assert [a["reason"] for a in attempts] == ["fresh", "resume"], attempts
    assert attempts[1]["start_step"] > 0
    assert "killed by SIGKILL" in attempts[1]["previous_failure"]
    print(f"first launch {first:.0f} s (one job killed), relaunch {relaunch:.0f} s")
