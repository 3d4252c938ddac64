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
