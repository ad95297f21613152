"""Check the data pipeline before spending GPU hours (from a notebook or a script).

    report = hpc_ddp.check_data(["data=cifar10", "data.root=/shared/data"], world_size=8)
    print(report)            # shards disjoint and covering, reshuffled per epoch, shapes, speed
    report.indices[3][:10]   # the first sample indices rank 3 trains on in epoch 0

It builds rank 0's data set and loader exactly as the trainer does (hpc_ddp.data.loaders),
and every rank's sampler over that data set (the trainer's sampler, with the trainer's
arguments), without starting any process. Every data kind works: the built-in ones, a
`_target_` factory's map-style data sets, an iterable data set (which shards itself, so
its shards are read rank by rank instead of drawn from a sampler), and shards (data=shards),
whose every rank's order is drawn from the sample counts alone, no shard read. A run that
may shrink (``cluster.min_nodes``) is checked in its global order: each rank's part of every
global micro-batch at ``world_size`` (data/global_order.py), the planned ranks' batch.
"""

from __future__ import annotations

import numbers
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hpc_ddp.config.schema import Config
from hpc_ddp.data.global_order import GlobalBatches, part, planned_ranks
from hpc_ddp.errors import UserError


@dataclass
class DataReport:
    world_size: int
    dataset_size: int
    # Sample indices per rank for the first epoch checked (rank -> list); for an iterable
    # data set, the number of samples each rank's shard yields (rank -> [count]).
    indices: dict[int, list[int]]
    disjoint: bool
    covers_dataset: bool
    # Padding DistributedSampler adds so every rank gets the same count.
    padded: int
    reshuffled_by_set_epoch: bool
    # Shapes and dtypes of the first batch's tensors: "images"/"labels" for the built-in
    # image data, "input"/"target" for other (input, target) pairs, else by position/key.
    batch_shapes: dict[str, tuple[int, ...]]
    batch_dtypes: dict[str, str]
    samples_per_s: float
    problems: list[str] = field(default_factory=list)
    # "map-style" (hpc_ddp's sampler shards it), "iterable" (it shards itself) or "shards".
    kind: str = "map-style"
    num_classes: int | None = None
    eval_size: int | None = None
    # shards: the train batches of each rank per epoch (all equal, or some rank would hang).
    batches_per_rank: list[int] = field(default_factory=list)
    # The global order (cluster.min_nodes): the global micro-batch and each rank's part.
    global_batch: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        per_rank = (len(self.indices[0]) if self.kind != "iterable" else
                     ", ".join(str(v[0]) for v in self.indices.values()))
        rows = [
            ("world size", self.world_size), ("data", self.kind),
            ("dataset size", self.dataset_size),
            ("eval size", "none" if self.eval_size is None else self.eval_size),
            ("classes", self.num_classes or "not said"),
            ("samples per rank", per_rank), ("padding", self.padded),
            *([("batches per rank", _spread(self.batches_per_rank))]
              if self.batches_per_rank else []),
            *([("global order", self.global_batch)] if self.global_batch else []),
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
    # deferred: torch; start-up: api
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
    planned = planned_ranks(cfg)  # a run that may shrink (min_nodes): the global order
    try:
        first = build_loaders(cfg.data, t.batch_size, 0, world_size, t.seed, planned=planned)
    except ValueError as exc:  # the global batch too small for the ranks or the data set
        if not planned:
            raise
        raise UserError("world_size", world_size, f"does not fit the global order: {exc}.",
                        "check trainer.batch_size, nodes and cluster.tasks_per_node.") from None
    sets = first.sets
    progress = _Progress(world_size)
    if planned and first.global_order:
        return _global_report(cfg, first, planned, world_size, epoch, batches, progress)
    if hasattr(sets.train, "order"):
        return _shard_report(cfg, first, world_size, epoch, batches, progress)
    if first.sampler is None:
        return _iterable_report(cfg, first, world_size, epoch, batches, progress)
    dataset = sets.train
    # DistributedSampler's order (a run without min_nodes)
    assert isinstance(first.sampler, ResumableDistributedSampler)
    indices = {}
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
    shapes, dtypes, speed, _ = _time_loader(first, epoch, batches)
    return DataReport(world_size, size, indices, disjoint, covers, padded,
                      next_epoch != indices[0], shapes, dtypes, speed, problems,
                      num_classes=sets.num_classes, eval_size=_size(sets.eval))


def _iterable_report(cfg: Config, first: Any, world_size: int, epoch: int, batches: int,
                     progress: _Progress) -> DataReport:
    """An IterableDataset shards itself: build each rank's and count what it yields."""
    from hpc_ddp.data.sets import build_datasets  # deferred (start-up): data.sets

    t = cfg.trainer
    counts: dict[int, list[int]] = {}
    problems = []
    for rank in range(world_size):
        sets = first.sets if rank == 0 else build_datasets(cfg.data, t.seed, rank, world_size)
        yielded = sum(1 for _ in sets.train)
        counts[rank] = [yielded]
        if yielded != len(sets.train):
            problems.append(f"rank {rank}'s shard yields {yielded} samples but its __len__ "
                            f"says {len(sets.train)}")
        progress.update(rank + 1)
    if len({c[0] for c in counts.values()}) > 1:
        problems.append("ranks get different numbers of samples: they would run different "
                        "numbers of steps and hang in a collective")
    shapes, dtypes, speed, _ = _time_loader(first, epoch, batches)
    total = sum(c[0] for c in counts.values())
    return DataReport(world_size, total, counts, True, True, 0, False, shapes, dtypes, speed,
                      problems, kind="iterable", num_classes=first.sets.num_classes,
                      eval_size=_size(first.sets.eval))


def _shard_report(cfg: Config, first: Any, world_size: int, epoch: int, batches: int,
                  progress: _Progress) -> DataReport:
    """Shards: every rank's order of the epoch from the index alone (shard_index.py)."""
    from hpc_ddp.data.shard_index import rank_order  # deferred (start-up): data.shard_index

    shards = first.sets.train
    counts, size = shards.split.counts, shards.split.total

    def order(rank: int, at: int) -> list[int]:
        return rank_order(counts, rank, world_size, cfg.trainer.seed, at,
                          cfg.data.shuffle_buffer).tolist()  # type: ignore[no-any-return]

    indices = {}
    for rank in range(world_size):
        indices[rank] = order(rank, epoch)
        progress.update(rank + 1)
    union = [i for shard in indices.values() for i in shard]
    padded = len(union) - size
    disjoint = len(set(union)) == len(union) - padded
    covers = set(union) == set(range(size))
    per_batch = cfg.trainer.batch_size
    counted = [-(-len(indices[r]) // per_batch) for r in range(world_size)]
    reshuffled = order(0, epoch + 1) != indices[0]
    problems = [text for bad, text in (
        (not disjoint, "ranks share samples beyond the padding"),
        (not covers, "some samples are never seen"),
        (len(set(counted)) > 1, "ranks get different numbers of batches: they would hang"),
        (not reshuffled, "set_epoch does not change the order: every epoch would be the same"),
    ) if bad]
    shapes, dtypes, speed, _ = _time_loader(first, epoch, batches)
    return DataReport(world_size, size, indices, disjoint, covers, padded, reshuffled, shapes,
                      dtypes, speed, problems, kind="shards", num_classes=first.sets.num_classes,
                      eval_size=None if first.sets.eval is None else first.sets.eval.split.total,
                      batches_per_rank=counted)


def _global_report(cfg: Config, first: Any, planned: int, world_size: int, epoch: int,
                   batches: int, progress: _Progress) -> DataReport:
    """Each rank's part of every global micro-batch of the epoch, by the trainer's own batch
    sampler (data/global_order.py) at ``world_size`` ranks, the run planned on ``planned``."""

    t = cfg.trainer
    glob = first.sampler
    assert isinstance(glob, GlobalBatches)
    sequence = list(glob.order(epoch))  # drawn once: every rank slices the same sequence
    indices = {}
    for rank in range(world_size):
        mine = GlobalBatches(glob.length, t.batch_size, planned, world_size, rank, t.seed,
                             order=lambda _epoch: sequence)
        indices[rank] = [i for part in mine.parts(epoch, 0) for i in part]
        progress.update(rank + 1)
    union = [i for part in indices.values() for i in part]
    whole = glob.micro_per_epoch * glob.global_batch
    disjoint = len(set(union)) == len(union)
    covers = set(union) == set(sequence[:whole])
    reshuffled = list(glob.order(epoch + 1)) != sequence
    problems = [text for bad, text in (
        (not disjoint, "a sample is in two ranks' parts"),
        (not covers, "the parts do not make up the whole micro-batches"),
        (not reshuffled, "set_epoch does not change the order: every epoch would be the same"),
    ) if bad]
    sizes = sorted({part(glob.global_batch, world_size, r)[1] for r in range(world_size)})
    described = (f"micro-batch of {glob.global_batch} ({t.batch_size} x {planned} planned "
                 f"ranks), parts of {' or '.join(map(str, sizes))} on {world_size}; "
                 f"{glob.micro_per_epoch} an epoch, {glob.length - whole} samples left out")
    shapes, dtypes, speed, _ = _time_loader(first, epoch, batches)
    shards = first.sets.iterable
    evaluation = first.sets.eval
    return DataReport(world_size, glob.length, indices, disjoint, covers, 0, reshuffled, shapes,
                      dtypes, speed, problems, kind="shards" if shards else "map-style",
                      num_classes=first.sets.num_classes, global_batch=described,
                      eval_size=(evaluation.split.total if shards and evaluation is not None
                                 else _size(evaluation)))


def _spread(values: list[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low} to {high} (unequal)"


def _size(dataset: Any) -> int | None:
    return None if dataset is None else len(dataset)


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


def _time_loader(loaders: Any, epoch: int, batches: int
                 ) -> tuple[dict[str, tuple[int, ...]], dict[str, str], float, int]:
    from hpc_ddp.trainer.objectives import batch_size  # deferred (start-up): trainer.objectives

    loaders.set_position(epoch, 0)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    seen = 0
    started = time.perf_counter()
    image_data = loaders.sets.stats is not None
    for n, batch in enumerate(loaders.train):
        if n == 0:
            for name, tensor in _leaves(batch, ("images", "labels") if image_data else
                                        ("input", "target")):
                shapes[name], dtypes[name] = tuple(tensor.shape), str(tensor.dtype)
        seen += batch_size(batch)
        if n + 1 >= batches:
            break
    elapsed = max(time.perf_counter() - started, 1e-9)
    return shapes, dtypes, seen / elapsed, seen


def _leaves(batch: Any, pair: tuple[str, str], prefix: str = "") -> list[tuple[str, Any]]:
    """(name, tensor) of every tensor in a batch: a pair is named ``pair``."""
    import torch  # deferred: torch

    if isinstance(batch, torch.Tensor):
        return [(prefix or "batch", batch)]
    if isinstance(batch, dict):
        items = [(str(k), v) for k, v in batch.items()]
    elif isinstance(batch, list | tuple):
        names = pair if len(batch) == 2 and not prefix else [str(i) for i in range(len(batch))]
        items = list(zip(names, batch, strict=True))
    else:
        return []
    return [leaf for key, value in items
            for leaf in _leaves(value, pair, f"{prefix}.{key}" if prefix else key)]
