"""The `budget` group: under `paper` an epoch of the bilevel methods is 20 batches, and the
next epoch reads on to new batches; `full` is every batch; an unknown name is refused."""

from __future__ import annotations

import lightning as L
import pytest
from hydra.errors import MissingConfigException

from calm_lightning.pipeline import run_experiment


class RecordBatches(L.Callback):
    """Keeps, per epoch, the token rows of every training batch the loop hands out."""

    def __init__(self) -> None:
        self.rows: dict[int, list[tuple]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        train = batch["train"]
        rows = [
            ids[mask.bool()].tolist()
            for ids, mask in zip(train["input_ids"], train["attention_mask"], strict=True)
        ]
        self.rows.setdefault(trainer.current_epoch, []).extend(map(tuple, rows))


def _tiny_calm(tmp_path, budget: str) -> list[str]:
    return [
        "model=tiny",
        "method=calm",
        f"budget={budget}",
        "~method_setting",  # the demo's own epoch size stays out: the budget decides
        "peft.r=2",
        "setting.test.limit=4",
        "setting.batch_size=4",  # 240 demo questions: 60 batches per pass
        "trainer.max_epochs=2",
        "method.module.inner_steps=1",
        "evaluation.compare_with_base=false",
        "trainer.enable_progress_bar=false",
        "logger=none",
        "callbacks=none",
        f"paths.output_dir={tmp_path}",
    ]


@pytest.mark.integration  # a whole tiny CALM job
def test_paper_budget_runs_20_outer_steps_per_epoch_on_new_batches(tmp_path, compose, monkeypatch):
    recorder = RecordBatches()
    monkeypatch.setattr("calm_lightning.pipeline.instantiate", _with_callback(recorder))
    result = run_experiment(compose(_tiny_calm(tmp_path, "paper")))
    assert result.extra["calm_steps"]["outer_steps"] == 40
    epochs = recorder.rows
    assert [len(epochs[e]) for e in (0, 1)] == [20 * 4, 20 * 4]
    # 40 batches of 4 from one shuffled pass of 240 questions: 160 different questions (the
    # full budget's epoch 1 would be a new permutation of all 240, repeating about a third)
    assert len(set(epochs[0] + epochs[1])) == 160


@pytest.mark.integration  # a whole tiny CALM job
def test_full_budget_epochs_are_new_permutations_of_every_batch(tmp_path, compose, monkeypatch):
    cfg = compose([*_tiny_calm(tmp_path, "full"), "trainer.limit_train_batches=10"])
    assert cfg.method.epoch_batches is None and cfg.budget.name == "full"
    recorder = RecordBatches()
    monkeypatch.setattr("calm_lightning.pipeline.instantiate", _with_callback(recorder))
    run_experiment(cfg)
    epochs = recorder.rows
    # Lightning reaches the batch sampler's set_epoch: epoch 1 is a new permutation (the same
    # 40 questions again would mean every epoch repeats epoch 0's order)
    assert len(epochs[0]) == len(epochs[1]) == 40
    assert len(set(epochs[0] + epochs[1])) > 50


def test_an_unknown_budget_is_refused_listing_the_known_ones(compose):
    with pytest.raises(MissingConfigException, match="budget") as err:
        compose(["budget=cheap"])
    assert "full" in str(err.value) and "paper" in str(err.value)


def _with_callback(callback):
    """`hydra.utils.instantiate` that adds `callback` to the Trainer it builds."""
    from hydra.utils import instantiate

    def build(node, *args, **kwargs):
        if node.get("_target_") == "lightning.pytorch.Trainer":
            kwargs["callbacks"] = [*kwargs.get("callbacks", []), callback]
        return instantiate(node, *args, **kwargs)

    return build
