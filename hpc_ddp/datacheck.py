"""Check the data pipeline before spending GPU hours (from a notebook or a script).

    report = hpc_ddp.check_data(["data=cifar10", "data.root=/shared/data"], world_size=8)
    print(report)            # shards disjoint and covering, reshuffled per epoch, shapes, speed
    report.indices[3][:10]   # the first sample indices rank 3 trains on in epoch 0

It builds rank 0's data set and loader exactly as the trainer does (hpc_ddp.data.loaders),
and every rank's sampler over that data set (the trainer's sampler, with the trainer's
arguments), without starting any process.
"""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.errors import UserError


@dataclass
class DataReport:
    world_size: int
    dataset_size: int
    # Sample indices per rank for the first epoch checked (rank -> list).
    indices: dict[int, list[int]]
    disjoint: bool
    covers_dataset: bool
    # Padding DistributedSampler adds so every rank gets the same count.
    padded: int
    reshuffled_by_set_epoch: bool
    batch_shapes: dict[str, tuple[int, ...]]
    batch_dtypes: dict[str, str]
    samples_per_s: float
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        rows = [
            ("world size", self.world_size), ("dataset size", self.dataset_size),
            ("samples per rank", len(self.indices[0])), ("padding", self.padded),
            ("shards disjoint", self.disjoint), ("shards cover the data", self.covers_dataset),
            ("set_epoch reshuffles", self.reshuffled_by_set_epoch),
            ("batch", ", ".join(f"{k} {v} {self.batch_dtypes[k]}"
                                for k, v in self.batch_shapes.items())),
            ("loader samples/s (one rank)", f"{self.samples_per_s:.0f}"),
            ("verdict", "ok" if self.ok else "; ".join(self.problems)),
        ]
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def check_data(config: Config | Sequence[str] = (), world_size: int = 2, epoch: int = 0,
               batches: int = 20) -> DataReport:
    """Shards, order, one batch and the loader's speed for ``world_size`` ranks."""
    from hpc_ddp.api import compose
    from hpc_ddp.data.loaders import build_loaders
    from hpc_ddp.data.sampler import ResumableDistributedSampler

    for name, value, least in (("world_size", world_size, 1), ("epoch", epoch, 0),
                               ("batches", batches, 1)):
        if not isinstance(value, numbers.Integral) or value < least:
            raise UserError(name, value, f"must be an integer >= {least}.",
                            f"pass e.g. {name}={max(least, 2 if name == 'world_size' else 0)}.")
    cfg = config if isinstance(config, Config) else compose(list(config))
    t = cfg.trainer
    # The data set is the same on every rank: build it once (building it per rank made a
    # large world_size take minutes), and each rank's sampler over it as build_loaders does.
    first = build_loaders(cfg.data, t.batch_size, 0, world_size, t.seed)
    dataset = first.train.dataset
    indices = {}
    progress = _Progress(world_size)
    for rank in range(world_size):
        sampler = first.sampler if rank == 0 else ResumableDistributedSampler(
            dataset, world_size, rank, t.seed)
        sampler.set_position(epoch, 0)
        indices[rank] = list(sampler)  # each rank draws the whole permutation: O(data set)
        progress.update(rank + 1)
    first.sampler.set_position(epoch + 1, 0)
    next_epoch = list(first.sampler)
    size = first.train_size
    union = [i for shard in indices.values() for i in shard]
    padded = len(union) - size
    disjoint = len(set(union)) == len(union) - padded
    covers = set(union) == set(range(size))
    problems = []
    if not disjoint:
        problems.append("ranks share samples beyond DistributedSampler's padding")
    if not covers:
        problems.append("some samples are never seen")
    if next_epoch == indices[0]:
        problems.append("set_epoch does not change the order: every epoch would be the same")
    shapes, dtypes, speed = _time_loader(first.train, first.sampler, epoch, batches)
    return DataReport(world_size, size, indices, disjoint, covers, padded,
                      next_epoch != indices[0], shapes, dtypes, speed, problems)


class _Progress:
    """A line on stderr every few seconds, once the shards take longer than that (thousands
    of ranks over a large data set)."""

    EVERY_S = 3.0

    def __init__(self, total: int) -> None:
        self.total = total
        self.last = time.monotonic()

    def update(self, done: int) -> None:
        now = time.monotonic()
        if now - self.last >= self.EVERY_S and done < self.total:
            self.last = now
            print(f"check_data: shards of {done} of {self.total} ranks drawn", file=sys.stderr,
                  flush=True)


def _time_loader(loader: Any, sampler: Any, epoch: int,
                 batches: int) -> tuple[dict[str, tuple[int, ...]], dict[str, str], float]:
    sampler.set_position(epoch, 0)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    seen = 0
    started = time.perf_counter()
    for n, (images, labels) in enumerate(loader):
        if n == 0:
            shapes = {"images": tuple(images.shape), "labels": tuple(labels.shape)}
            dtypes = {"images": str(images.dtype), "labels": str(labels.dtype)}
        seen += int(labels.shape[0])
        if n + 1 >= batches:
            break
    elapsed = max(time.perf_counter() - started, 1e-9)
    return shapes, dtypes, seen / elapsed
