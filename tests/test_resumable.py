"""A run resumed from a mid-epoch step checkpoint reads exactly the batches the uninterrupted run
read after that step, in the same order, for the training loader and the cycling held-out one,
also when `configure_optimizers` reads `trainer.estimated_stepping_batches` first (as every
training method's LR schedule does), which makes Lightning drop the loaders' saved positions
unless `load_pending_loader_states` hands them over."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader

from calm_lightning.data.resumable import ResumableLoader, load_pending_loader_states
from calm_lightning.runtime.distributed import ShardedBatchSampler


def _loader(n: int, seed: int) -> ResumableLoader:
    sampler = ShardedBatchSampler(n, 2, shuffle=True, seed=seed, drop_last=True)
    return ResumableLoader(torch.arange(n), batch_sampler=sampler)


class Recorder(L.LightningModule):
    """Records every batch it trains on; its LR schedule needs the run's step count."""

    def __init__(self, seen: list, stop_at: int | None = None) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen, self.stop_at = seen, stop_at

    def train_dataloader(self):
        # 6 training batches an epoch; the held-out loader's 2 batches cycle
        return CombinedLoader(
            {"train": _loader(12, 0), "heldout": _loader(4, 1)}, mode="max_size_cycle"
        )

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.layer.parameters(), lr=0.1)
        total = self.trainer.estimated_stepping_batches
        return [optimizer], [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 - s / total)]

    def on_train_start(self) -> None:
        load_pending_loader_states(self.trainer)

    def on_train_batch_start(self, batch, batch_idx) -> None:
        if self.global_step == self.stop_at:
            raise RuntimeError("simulated kill")

    def training_step(self, batch, batch_idx):
        self.seen.append((batch["train"].tolist(), batch["heldout"].tolist()))
        return self.layer(batch["train"].float()[:, None]).sum()


def _trainer(tmp_path, limit) -> L.Trainer:
    steps = ModelCheckpoint(tmp_path / "ckpt", filename="{step}", every_n_train_steps=1,
                            save_top_k=-1)  # fmt: skip
    epochs = ModelCheckpoint(tmp_path / "ckpt", filename="end{epoch}", save_top_k=-1)
    return L.Trainer(max_epochs=2, callbacks=[steps, epochs], logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     default_root_dir=tmp_path, limit_train_batches=limit)  # fmt: skip


@pytest.mark.parametrize(
    ("limit", "stop_at", "checkpoint"),
    [
        (None, 1, "step=1"),
        (None, 3, "step=3"),
        (None, 7, "step=7"),
        (None, 6, "endepoch=0"),  # an epoch-end checkpoint
        (None, 6, "step=6"),  # a step checkpoint at an epoch's last batch (sampler exhausted)
        (4, 4, "endepoch=0"),  # an epoch cut by limit_train_batches, its loaders not exhausted
        (4, 4, "step=4"),  # a step checkpoint at that epoch's last batch
        (4, 5, "step=5"),
    ],
)
def test_a_resume_reads_the_uninterrupted_runs_batches(tmp_path, limit, stop_at, checkpoint):
    full: list = []
    _trainer(tmp_path / "full", limit).fit(Recorder(full))
    per_epoch = limit or 6
    assert len(full) == 2 * per_epoch and len({str(b) for b in full[:per_epoch]}) == per_epoch

    before: list = []
    with pytest.raises(RuntimeError, match="simulated kill"):
        _trainer(tmp_path / "job", limit).fit(Recorder(before, stop_at=stop_at))
    ckpt = tmp_path / "job" / "ckpt" / f"{checkpoint}.ckpt"
    assert ckpt.is_file(), sorted(p.name for p in ckpt.parent.iterdir())
    after: list = []
    _trainer(tmp_path / "job", limit).fit(Recorder(after), ckpt_path=ckpt)

    assert before == full[:stop_at]
    assert after == full[stop_at:]
