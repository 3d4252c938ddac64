"""Kill and resume: a CALM run interrupted after its first epoch and resumed with
`ckpt_path=<run dir>` ends with the same metrics as an uninterrupted run of the same seed."""

from __future__ import annotations

import json

import lightning as L
import numpy as np
import pytest

from calm_lightning.errors import ConfigError
from calm_lightning.pipeline import run_experiment


class KillAtSecondEpoch(L.Callback):
    """Stands in for a killed process: dies as the second epoch starts (after the epoch-end
    checkpoint of the first)."""

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 1:
            raise RuntimeError("simulated kill")


def _probs(run_dir) -> np.ndarray:
    rows = (run_dir / "predictions.jsonl").read_text().splitlines()
    return np.array([json.loads(r)["probs"] for r in rows])


# The persistent amortized surrogate and its Adam moments carry across the kill: the resumed
# run must take both from the checkpoint.
AMORTIZED = [
    "method.module.surrogate.schedule=amortized",
    "method.module.surrogate.steps=2",
    "method.module.inner_lr=0.5",  # a surrogate far from theta, so which one is used shows
]


PER_STEP = ["method.module.surrogate.schedule=per_step"]


@pytest.mark.integration
@pytest.mark.parametrize("extra", [PER_STEP, AMORTIZED], ids=["per_step", "amortized"])
def test_kill_and_resume_equals_the_uninterrupted_run(tmp_path, compose, resume_overrides, extra):
    run = [*resume_overrides, *extra]
    full = run_experiment(compose(run, tmp_path / "full")).metrics
    killed = compose(
        [*run, "+callbacks.kill._target_=tests.test_resume.KillAtSecondEpoch"], tmp_path / "killed"
    )
    with pytest.raises(RuntimeError, match="simulated kill"):
        run_experiment(killed)
    assert (tmp_path / "killed" / "checkpoints" / "last.ckpt").is_file()
    resumed = run_experiment(
        compose([*run, f"ckpt_path={tmp_path / 'killed'}"], tmp_path / "resumed")
    ).metrics
    # Parameters, optimizer moments, schedules and batches at the resume point are bit-equal
    # to the uninterrupted run's; BLAS summation order can still differ in the last bits
    # afterwards (CPU kernels depend on buffer alignment), so compare within a float tolerance.
    np.testing.assert_allclose(_probs(tmp_path / "resumed"), _probs(tmp_path / "full"), atol=1e-4)
    for key in ("accuracy", "conf_ece", "cw_ece", "brier", "nll"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-4, abs=1e-4), key
    # The run really changed the model, so equality is not the trivial untrained case.
    assert not np.allclose(_probs(tmp_path / "full")[:, 0], 0.25)


def test_missing_checkpoint_is_a_clear_error(tmp_path, compose, resume_overrides):
    with pytest.raises(ConfigError, match="no checkpoint at"):
        run_experiment(compose([*resume_overrides, f"ckpt_path={tmp_path / 'nowhere'}"], tmp_path))


class KillAtStep(L.Callback):
    """Dies before training step `step` (global), after the checkpoint of the step before."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError("simulated kill")


@pytest.mark.integration
@pytest.mark.parametrize("kill_at", [1, 5], ids=["epoch0-batch1", "epoch1-batch2"])
def test_a_mid_epoch_kill_resumes_exactly_in_the_same_folder(
    tmp_path, compose, resume_overrides, kill_at
):
    """Checkpoints after every step; killed inside the second epoch and relaunched with the
    same command (ckpt_path=auto): the loaders continue where they stopped, so the metrics
    equal the uninterrupted run's, and the attempts say where each start began."""
    # later overrides of a key win: 3 batches per epoch, a checkpoint after every step
    extra = ["trainer.limit_train_batches=3", "callbacks.periodic.every_n_train_steps=1"]
    run = [*resume_overrides, *extra]
    full = run_experiment(compose(run, tmp_path / "full")).metrics
    kill = [f"+callbacks.kill._target_={__name__}.KillAtStep", f"+callbacks.kill.step={kill_at}"]
    with pytest.raises(RuntimeError, match="simulated kill"):
        run_experiment(compose([*run, *kill], tmp_path / "job"))
    resumed = run_experiment(compose(run, tmp_path / "job")).metrics
    np.testing.assert_allclose(_probs(tmp_path / "job"), _probs(tmp_path / "full"), atol=1e-4)
    for key in ("accuracy", "conf_ece", "nll"):
        assert resumed[key] == pytest.approx(full[key], rel=1e-4, abs=1e-4), key
    summary = json.loads((tmp_path / "job" / "metrics.json").read_text())
    assert [(a["reason"], a["start_step"]) for a in summary["attempts"]] == [
        ("fresh", 0),
        ("resume", kill_at),
    ]
    assert not [p for p in (tmp_path / "job").rglob(".*") if p.name != ".job.lock"]
