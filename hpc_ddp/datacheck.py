"""Check the data pipeline before spending GPU hours (from a notebook or a script).

    report = hpc_ddp.check_data(["data=cifar10", "data.root=/shared/data"], world_size=8)
    print(report)            # shards disjoint and covering, reshuffled per epoch, shapes, speed
    report.indices[3][:10]   # the first sample indices rank 3 trains on in epoch 0

It builds each rank's sampler and loader exactly as the trainer does (hpc_ddp.data.loaders),
without starting any process.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.config.schema import Config


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

    cfg = config if isinstance(config, Config) else compose(list(config))
    t = cfg.trainer
    loaders = [build_loaders(cfg.data, t.batch_size, r, world_size, t.seed)
               for r in range(world_size)]
    indices = {}
    for rank, loader in enumerate(loaders):
        loader.sampler.set_position(epoch, 0)
        indices[rank] = list(loader.sampler)
    loaders[0].sampler.set_position(epoch + 1, 0)
    next_epoch = list(loaders[0].sampler)
    size = loaders[0].train_size
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
    shapes, dtypes, speed = _time_loader(loaders[0].train, loaders[0].sampler, epoch, batches)
    return DataReport(world_size, size, indices, disjoint, covers, padded,
                      next_epoch != indices[0], shapes, dtypes, speed, problems)


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
