"""A training loader that a checkpoint taken mid-epoch resumes exactly.

Lightning saves the state of every training loader that implements `state_dict` /
`load_state_dict` (its `_Stateful` protocol) in each checkpoint, and hands it back before the
first batch of a resumed epoch. A plain `DataLoader` has no state, so a run resumed from a
mid-epoch checkpoint would read the epoch's first batches again and never reach its last ones.
`ResumableLoader` records the epoch and how many of its batches were handed out; on load its
`ShardedBatchSampler` skips those, so the resumed run trains on exactly the batches the
uninterrupted run would have (tests/test_resume.py).

The count is of batches handed to the training loop, not of indices the sampler produced:
worker processes (`num_workers > 0`) read ahead, the loop does not. Lightning does not prefetch
from loaders with a length, so at a checkpoint every batch handed out has been trained on.

Lightning hands the states back only if the training loaders are built after the checkpoint's
loop state is read. `trainer.estimated_stepping_batches` (the LR schedules' step count, read in
`configure_optimizers`) builds them earlier, and Lightning then drops the states silently
(Lightning issue #20550): the resumed epoch would start again at its first batch.
`load_pending_loader_states` (called in the training methods' `on_train_start`) loads them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from calm_lightning.errors import ConfigError
from calm_lightning.runtime.distributed import ShardedBatchSampler


class ResumableLoader(DataLoader):
    """A `DataLoader` over a `ShardedBatchSampler` whose position survives a checkpoint."""

    def __init__(self, *args, batch_sampler: ShardedBatchSampler, **kwargs) -> None:
        # Every new iterator draws a worker base seed; from the global generator that draw
        # would shift LoRA dropout's masks by one whenever a resumed run creates its iterator
        # at another moment than the uninterrupted run did. A generator of its own keeps the
        # global stream the model's alone.
        kwargs.setdefault("generator", torch.Generator().manual_seed(batch_sampler.seed))
        super().__init__(*args, batch_sampler=batch_sampler, **kwargs)
        if not isinstance(self.batch_sampler, ShardedBatchSampler):
            raise TypeError("ResumableLoader needs a ShardedBatchSampler as its batch_sampler")
        self._handed_out = 0
        self._skip_epoch: int | None = None  # the epoch a loaded position belongs to

    def __iter__(self) -> Iterator:
        # A generator: its body (and the sampler's skip) runs at the first batch, after
        # Lightning has restored the state and set the epoch. A position saved at an epoch's
        # end (the epoch cut short by `limit_train_batches`, or a step checkpoint at its last
        # batch) belongs to an epoch that is over: the next one starts at its first batch.
        if self._skip_epoch is not None and self._skip_epoch != self.batch_sampler.epoch:
            self.batch_sampler.skip = 0
        self._skip_epoch = None
        self._handed_out = self.batch_sampler.skip
        for batch in super().__iter__():
            self._handed_out += 1
            yield batch

    def _identity(self) -> dict:
        sampler = self.batch_sampler
        return {
            "n": sampler.n,
            "batch_size": sampler.batch_size,
            "seed": sampler.seed,
            "epoch_batches": sampler.epoch_batches,
        }

    def state_dict(self) -> dict:
        return {
            **self._identity(),
            "epoch": self.batch_sampler.epoch,
            "batches": self._handed_out,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = self._identity()
        theirs = {key: state.get(key) for key in mine}
        if theirs != mine:
            raise ConfigError(
                f"the checkpoint's training data position was saved for other data ({theirs}; "
                f"this run: {mine}): resume with the configuration the checkpoint was written "
                "with, or start the run afresh"
            )
        sampler = self.batch_sampler
        sampler.set_epoch(int(state["epoch"]))
        # A checkpoint taken after an epoch's last batch resumes at the next epoch's start,
        # which Lightning announces itself (set_epoch); nothing is left to skip here.
        batches = int(state["batches"])
        sampler.skip = batches if batches < len(sampler) else 0
        self._skip_epoch = int(state["epoch"])
        self._handed_out = sampler.skip


def load_pending_loader_states(trainer) -> None:
    """Give the training loaders the positions a resumed checkpoint saved, if Lightning left
    them unloaded (issue #20550, see the module docstring): call before the first batch.

    Deliberately reaches into the fit loop's private fields; there is no public hook for this.
    Once Lightning loads them itself, nothing is pending here and this does nothing. The loaders
    read their position at their first batch (`ResumableLoader.__iter__` is a generator), so the
    iterators Lightning created before this call still start where the checkpoint stopped.
    """
    loop = trainer.fit_loop
    pending = getattr(loop, "_combined_loader_states_to_load", None)
    combined = getattr(loop, "_combined_loader", None)
    if pending and combined is not None:
        combined._load_state_dicts(pending)
        loop._combined_loader_states_to_load = []
