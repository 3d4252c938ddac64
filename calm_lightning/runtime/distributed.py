"""Data parallelism the project's own way: batch sharding, global means, gathers.

Lightning runs the processes (`trainer=ddp`); this module makes what they compute equal to
what one process computes on the concatenated batch (docs/scaling.md):

* `ShardedBatchSampler`: every rank cuts the same permutation (or the file order) into the
  same global batches, and takes its own slice of each, so W processes with batch b see
  exactly the batches one process with batch W * b sees;
* `GlobalMean`: a loss averaged over a rank's tokens becomes the global batch's token mean
  (each rank's value and gradients weighted by its share of the tokens, then summed), which
  DDP's plain average of rank means is not when ranks hold different token counts;
* `gather_objects`: evaluation rows from every rank, for metrics written once by rank 0.

With one process (or no process group) everything here is the identity, at no cost.

Every collective of the code base is called here, and every one takes its tensors on
`collective_device()`, the device the process group's backend reduces on (NCCL: the current
CUDA device only; gloo: the CPU), whatever device the caller's tensors live on; results come
back on the caller's devices. No helper takes a device argument, so no call site can forget
or mistake it (tests/test_distributed.py enforces both rules, docs/scaling.md).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

from calm_lightning.errors import ConfigError


def world() -> tuple[int, int]:
    """(rank, world size) of the current process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_distributed() -> bool:
    return world()[1] > 1


def collective_device() -> torch.device:
    """The device whose tensors the process group's backend reduces: the current CUDA device
    under NCCL (which has no CPU implementation: "No backend type associated with device type
    cpu"; Lightning sets the current device to the process's GPU), the CPU under gloo or MPI.
    Only called with a process group of several processes."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Element-wise sums over ranks of a list of tensors, in one collective (fp32 buffer on
    `collective_device()`); each sum comes back on its tensor's device and dtype."""
    tensors = list(tensors)
    if not is_distributed() or not tensors:
        return tensors
    # fp32 for 16-bit tensors (a bf16 sum over ranks loses digits), fp64 kept as fp64.
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    device = collective_device()
    flat = torch.cat([t.detach().reshape(-1).to(device, dtype) for t in tensors])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    out, start = [], 0
    for t in tensors:
        out.append(flat[start : start + t.numel()].view_as(t).to(t.device, t.dtype))
        start += t.numel()
    return out


def any_rank(flag: bool) -> bool:
    """Whether `flag` holds on any rank (every rank gets the same answer)."""
    if not is_distributed():
        return bool(flag)
    value = torch.tensor([1.0 if flag else 0.0], device=collective_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item() > 0)


def gather_objects(obj) -> list:
    """`obj` from every rank, in rank order (picklable objects; tensors on the CPU). torch
    moves the pickled bytes to the backend's device itself (the current CUDA device under
    NCCL), as `collective_device()` would."""
    if not is_distributed():
        return [obj]
    out: list = [None] * world()[1]
    dist.all_gather_object(out, obj)
    return out


class GlobalMean:
    """Turns rank-local means into the global batch's mean.

    A loss that averages over `count` items on this rank (tokens, questions) contributes
    share = count / (sum of counts over ranks) of the global mean. `value(loss, count)` is the
    global mean of the loss (on every rank); `gradients(grads, count)` the gradient of that
    global mean. `weight(count)` is the factor that makes DDP's averaged gradient of
    `weight * loss` the gradient of the global mean (world size * share), for methods whose
    backward goes through DDP's own all-reduce.

    Its collectives run on `collective_device()`; `share` and `weight` are on that device (a
    0-dim CPU tensor with one process), the sums on their tensors' devices.
    """

    def share(self, count) -> torch.Tensor:
        if not is_distributed():
            return torch.ones((), dtype=torch.float64, device="cpu")
        local = torch.as_tensor(count, dtype=torch.float64, device=collective_device())
        local = local.reshape(1)
        total = local.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        if float(total) <= 0:
            raise ConfigError("no rank holds an item of this batch (empty shards)")
        return (local / total).reshape(())

    def weight(self, count) -> torch.Tensor:
        return self.share(count) * world()[1]

    def _weighted_sum(self, tensors: Sequence[torch.Tensor | None], count) -> list:
        """Sum over ranks of share x tensor, for every tensor in one collective; None (a
        parameter the loss does not reach, the same on every rank) stays None."""
        tensors = [None if t is None else t.detach() for t in tensors]
        if not is_distributed():
            return tensors
        share = self.share(count)
        present = [i for i, t in enumerate(tensors) if t is not None]
        summed = all_reduce_sum(
            [tensors[i] * share.to(tensors[i].device, tensors[i].dtype) for i in present]
        )
        for i, t in zip(present, summed, strict=True):
            tensors[i] = t
        return tensors

    def value(self, loss: torch.Tensor, count) -> torch.Tensor:
        return self._weighted_sum([loss], count)[0]

    def gradients(self, grads: Sequence[torch.Tensor | None], count) -> list:
        return self._weighted_sum(grads, count)

    def both(self, loss: torch.Tensor, grads, count) -> tuple[torch.Tensor, list]:
        """`value` and `gradients` with one share and one sum (two collectives, not four)."""
        out = self._weighted_sum([loss, *grads], count)
        return out[0], out[1:]


class ShardedBatchSampler(torch.utils.data.Sampler):
    """Batches of indices 0..n-1, the same global batches on every world size.

    `shuffle`: a permutation that depends only on (seed, epoch) (Lightning calls `set_epoch`
    at every epoch start, through `sampler` below, so a run resumed from an epoch-end
    checkpoint sees exactly the batches an uninterrupted run would); otherwise file order.
    The order is cut into global
    batches of `batch_size * world` indices (the last, shorter one dropped when `drop_last`
    and at least one full batch exists); with `shard="slice"` rank r takes positions
    [r * batch_size, (r + 1) * batch_size) of each global batch (training: equal batch counts
    on every rank, as collectives need), with `shard="round_robin"` global batches of
    `batch_size` go to ranks in turn (evaluation: the very batches one process would score;
    batch j of process r is batch j * world + r of one process).

    `epoch_batches`: an epoch is that many global batches, read from one stream that
    concatenates the passes over the data (pass p: the permutation of (seed, p), cut into
    batches), so epoch e takes the stream's batches [e * epoch_batches, (e + 1) *
    epoch_batches): successive epochs see new batches, and a pass is never cut short by an
    epoch end (the paper budget's 20-batch epochs of the bilevel methods, docs/calm.md). Data
    of at most `epoch_batches` batches makes an epoch one pass, as None does: the permutation
    of (seed, epoch).

    `skip`: the next iteration starts after that many of the epoch's batches (an exact
    mid-epoch resume; `ResumableLoader` sets it and clears it after one iteration).

    The rank and world size are read when iterating, so a loader built before the process
    group exists still shards correctly.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        shard: str = "slice",
        epoch_batches: int | None = None,
    ) -> None:
        if shard not in ("slice", "round_robin"):
            raise ValueError(f"shard={shard!r} is not slice or round_robin")
        if epoch_batches is not None and (shard != "slice" or int(epoch_batches) < 1):
            raise ValueError(f"epoch_batches={epoch_batches!r} needs shard='slice' and >= 1")
        self.n, self.batch_size, self.shuffle = int(n), int(batch_size), shuffle
        self.seed, self.drop_last, self.shard, self.epoch = seed, drop_last, shard, 0
        self.epoch_batches = None if epoch_batches is None else int(epoch_batches)
        self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    @property
    def sampler(self) -> ShardedBatchSampler:
        """Itself: Lightning calls `set_epoch` at every epoch start on a loader's `sampler` and
        on its `batch_sampler.sampler`, never on the batch sampler itself, so this is how the
        epoch reaches the order (without it every epoch repeats epoch 0's batches)."""
        return self

    def order(self, data_pass: int | None = None) -> list[int]:
        """The index order of one pass over the data (default: the current epoch's)."""
        if not self.shuffle:
            return list(range(self.n))
        data_pass = self.epoch if data_pass is None else data_pass
        generator = torch.Generator().manual_seed(self.seed * 100_003 + data_pass)
        return torch.randperm(self.n, generator=generator).tolist()

    def _pass_batches(self, step: int, data_pass: int | None = None) -> list[list[int]]:
        order = self.order(data_pass)
        batches = [order[i : i + step] for i in range(0, self.n, step)]
        if self.drop_last and len(batches) > 1 and len(batches[-1]) < step:
            batches.pop()
        return batches

    def _stream_batches(self, step: int) -> list[list[int]]:
        """Epoch `self.epoch`'s slice of the stream of passes (`epoch_batches`); data of no
        more than `epoch_batches` batches makes one pass an epoch, as without the option."""
        full, rest = divmod(self.n, step)  # batches per pass, as _pass_batches cuts them
        per_pass = full + bool(rest) - bool(self.drop_last and full and rest)
        if per_pass <= self.epoch_batches:
            return self._pass_batches(step)
        start = self.epoch * self.epoch_batches
        out: list[list[int]] = []
        data_pass, offset = divmod(start, per_pass)
        while len(out) < self.epoch_batches:
            out.extend(self._pass_batches(step, data_pass)[offset:])
            data_pass, offset = data_pass + 1, 0
        return out[: self.epoch_batches]

    def _global_batches(self) -> list[list[int]]:
        rank, size = world()
        step = self.batch_size * (size if self.shard == "slice" else 1)
        if self.epoch_batches is not None:
            batches = self._stream_batches(step)
        else:
            batches = self._pass_batches(step)
        if self.shard == "round_robin":
            # Fewer batches than processes: the idle ones score a copy of the first batch
            # (Lightning needs a batch on every process); its index, >= `n_global`, marks it
            # as padding to drop after the gather.
            return batches[rank::size] or batches[:1]
        if size > 1 and self.n < step:
            raise ConfigError(
                f"{self.n} examples cannot fill one global batch of {step} "
                f"({size} processes x batch {self.batch_size}): lower setting.batch_size or "
                "use fewer devices"
            )
        return [b[rank * self.batch_size : (rank + 1) * self.batch_size] for b in batches]

    @property
    def n_global(self) -> int:
        """Round-robin: how many distinct batches all processes together score."""
        return -(-self.n // self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        return iter(self._global_batches()[skip:])

    def __len__(self) -> int:
        return len(self._global_batches())


def is_main_process() -> bool:
    """Whether this process writes the run's files: global rank 0 of the process group, or,
    before the group exists, the process the launcher's environment calls rank 0 (Lightning's
    child processes and SLURM tasks know their rank from the start)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    import os

    for name in ("RANK", "SLURM_PROCID"):
        if os.environ.get(name) not in (None, ""):
            if name == "SLURM_PROCID" and int(os.environ.get("SLURM_NTASKS", "1")) < 2:
                continue  # one task in an allocation: not a distributed launch
            return int(os.environ[name]) == 0
    return int(os.environ.get("LOCAL_RANK", 0)) == 0 and int(os.environ.get("NODE_RANK", 0)) == 0
