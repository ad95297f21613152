"""DistributedSampler that can start mid-epoch.

DistributedSampler has no mid-epoch state (its only state is ``set_epoch``, see
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler),
so resuming at sample k of an epoch needs our own offset. The permutation stays
DistributedSampler's own (seed + epoch), so a resumed run visits exactly the samples an
uninterrupted run would, in the same order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    def __init__(self, dataset: Any, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True,
                         seed=seed, drop_last=False)
        self.start = 0

    def set_position(self, epoch: int, start: int) -> None:
        """Next iteration: epoch ``epoch`` from this rank's ``start``-th sample on."""
        self.set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return self.num_samples - self.start


def eval_shard(length: int, rank: int, world_size: int) -> list[int]:
    """Disjoint, unpadded eval shards: every sample counted exactly once across ranks."""
    return list(range(rank, length, world_size))
