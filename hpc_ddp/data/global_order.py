"""Each step's samples fixed by the global batch index, whatever the world size.

With ``cluster.min_nodes`` a run may go on with fewer ranks after a node is lost, and grow
back at its next requeue (docs/fault-tolerance.md#shrinking-past-a-lost-node). A
DistributedSampler gives rank r of W the samples r, r+W, r+2W, ... of the epoch's
permutation, and each rank takes ``batch_size`` of them a step: both the global batch
(``batch_size`` x W) and the set of samples a step trains on change with W. Here:

- the global micro-batch is fixed: ``batch_size`` x the ranks the run was planned with
  (``nodes`` x ``tasks_per_node``), M samples;
- micro-batch k of an epoch is ``permutation(seed + epoch)[k*M:(k+1)*M]`` (torch's randperm,
  the permutation DistributedSampler draws), by k alone;
- rank r of W takes a contiguous part of it, the parts differing by at most one sample
  (64 on 3 ranks: 22, 21, 21), and weighs its mean loss by ``part x W / M``, so that the
  mean over ranks DDP (or FSDP's reduce-scatter) takes of the gradients is the mean over the
  M samples: the optimizer sees the same global batch at any W;
- ``data=shards`` takes the same slices of its own epoch sequence (shards.py), the same
  on every rank;
- an epoch is ``len // M`` whole micro-batches (the rest of the permutation is left out, as
  ``drop_last`` does), so a checkpoint's position (the micro-batch of the epoch) means the
  same samples on any W.

What stays inexact across a change of W: the order in which floating-point sums are taken
(each rank's part, then the all-reduce over W ranks), so losses agree to rounding, not bit
for bit; random augmentation drawn per rank (the built-in flip and crop) differs; an iterable data
set of the user's orders itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpc_ddp.config.schema import Config


def planned_ranks(cfg: Config) -> int | None:
    """The ranks a run was planned with when it keeps the global order (a Slurm run with
    ``cluster.min_nodes``: it may shrink); None: the usual per-rank order."""
    c = cfg.cluster
    if c.kind != "slurm" or c.min_nodes is None:
        return None
    return cfg.nodes * (c.tasks_per_node or 1)


def part(total: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s contiguous part of ``total`` items over ``world`` ranks:
    the first ``total % world`` ranks take one more."""
    base, extra = divmod(total, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


class GlobalBatches:
    """A batch sampler: this rank's indices of each global micro-batch of the epoch.

    ``batch_size``: the per-rank batch the run was planned with; ``planned``: the ranks it
    was planned with (the global micro-batch is their product); ``world``/``rank``: now.
    Give it to a DataLoader as ``batch_sampler=`` (or as ``sampler=`` with
    ``batch_size=None`` for a data set that takes a list of indices), and multiply each
    micro-batch's mean loss by :attr:`weight` before ``backward()``.
    """

    def __init__(self, length: int, batch_size: int, planned: int, world: int, rank: int,
                 seed: int = 0, order: Callable[[int], Sequence[int]] | None = None) -> None:
        self.global_batch = batch_size * planned
        if self.global_batch < world:
            raise ValueError(f"a global batch of {self.global_batch} samples cannot feed "
                             f"{world} ranks (at least one sample each)")
        if length < self.global_batch:
            raise ValueError(f"the data set has {length} samples, fewer than one global batch "
                             f"({batch_size} x {planned} ranks = {self.global_batch})")
        self.length, self.batch_size = length, batch_size
        self.world, self.rank, self.seed = world, rank, seed
        self.epoch = 0
        self.start = 0  # micro-batches of the epoch already trained
        self.offset, self.size = part(self.global_batch, world, rank)
        # The epoch's sequence of samples (default: a permutation drawn from seed + epoch;
        # shards: their shard-then-window shuffle over all ranks, shard_index.global_order).
        self._order = order

    @property
    def weight(self) -> float:
        """This rank's loss weight: its share of the global micro-batch times the world
        size (1.0 when the parts are equal)."""
        return self.size * self.world / self.global_batch

    @property
    def micro_per_epoch(self) -> int:
        return self.length // self.global_batch

    @property
    def num_samples(self) -> int:
        """An epoch counted in the planned per-rank batches (what the trainer divides by
        ``batch_size`` to count its micro-batches)."""
        return self.micro_per_epoch * self.batch_size

    def set_position(self, epoch: int, start: int) -> None:
        """Next iteration: epoch ``epoch``, from the micro-batch ``start // batch_size`` on
        (``start`` as the trainer counts it: micro-batches done x ``batch_size``)."""
        self.epoch, self.start = epoch, start // self.batch_size

    def set_epoch(self, epoch: int) -> None:
        self.set_position(epoch, 0)

    def order(self, epoch: int) -> Sequence[int]:
        if self._order is not None:
            return self._order(epoch)
        import torch  # deferred: torch

        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.length, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        return self.parts(self.epoch, self.start)

    def parts(self, epoch: int, start: int, every: int = 1) -> Iterator[list[int]]:
        """This rank's part of micro-batches ``start``, ``start + every``, ... of ``epoch``
        (``every``: the loader workers that share them, each from its own ``start``)."""
        order = self.order(epoch)
        for k in range(start, self.micro_per_epoch, every):
            first = k * self.global_batch + self.offset
            yield [int(i) for i in order[first:first + self.size]]

    def __len__(self) -> int:
        return self.micro_per_epoch - self.start
