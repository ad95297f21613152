"""Build the datasets and loaders a rank trains and evaluates on.

The loader settings left on auto (``None`` in :class:`DataConfig`) are chosen here from the
device and the task's CPUs (:func:`loader_settings`); docs/performance.md has the measurements
behind each choice. None of them changes which samples a batch holds or their order: the
sampler runs in the main process and workers only slice the tensors or decode the files
(whose random crops come from each sample's own seed, images.py); shards order themselves
the same way for any number of workers (shards.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Subset

from hpc_ddp.config.schema import DataConfig
from hpc_ddp.data.global_order import GlobalBatches
from hpc_ddp.data.gpu_decode import GpuDecoded
from hpc_ddp.data.sampler import ResumableDistributedSampler, eval_shard
from hpc_ddp.data.sets import DataSets, build_datasets
from hpc_ddp.data.tensor_dataset import BatchedSampler, ImageTensorDataset

# Workers beyond this feed no GPU faster: a batch is a slice of memory, not a decoded file.
MAX_AUTO_WORKERS = 4
# Files to decode: one core decodes ~700 224-px ImageNet-sized JPEGs a second
# (docs/performance.md) and a GPU trains ResNet-50 on thousands: every core of the task but
# the main process's, up to this.
MAX_DECODE_WORKERS = 16


@dataclass
class Loaders:
    train: Any
    eval: Any | None
    # The train set's sampler (None for an iterable data set, which shards itself); the
    # global order's batch sampler under cluster.min_nodes (data/global_order.py; for
    # shards, the one they order themselves by).
    sampler: ResumableDistributedSampler | GlobalBatches | None
    sets: DataSets
    settings: LoaderSettings | None = None

    @property
    def train_size(self) -> int:
        return len(self.sets.train)

    @property
    def seekable(self) -> bool:
        """The train loader starts where set_position says (an iterable data set without
        set_position starts at its beginning: the trainer skips into it)."""
        return self.sampler is not None or hasattr(self.sets.train, "set_position")

    def set_position(self, epoch: int, start: int) -> None:
        """Next pass over the train set: epoch ``epoch`` from this rank's ``start``-th sample.
        (A data set is told the epoch if it takes it: image files draw their crops from it.)"""
        if self.sampler is not None:
            self.sampler.set_position(epoch, start)
        if hasattr(self.sets.train, "set_position"):
            self.sets.train.set_position(epoch, start)
        elif hasattr(self.sets.train, "set_epoch"):
            self.sets.train.set_epoch(epoch)

    @property
    def global_order(self) -> bool:
        """Each step's samples by the global batch index (cluster.min_nodes)."""
        return isinstance(self.sampler, GlobalBatches)

    @property
    def loss_weight(self) -> float:
        """This rank's loss weight (global order: its share of the global batch)."""
        return self.sampler.weight if isinstance(self.sampler, GlobalBatches) else 1.0

    def weighed(self, loss: Any) -> Any:
        """A micro-batch's mean loss as this rank's share of the global batch weighs it
        (unchanged, not even multiplied, when the shares are equal)."""
        return loss if self.loss_weight == 1.0 else loss * self.loss_weight

    def samples_per_epoch(self) -> int:
        """This rank's train samples per epoch (equal on every rank)."""
        return self.sampler.num_samples if self.sampler is not None else len(self.sets.train)


@dataclass(frozen=True)
class LoaderSettings:
    """The DataLoader options in effect, auto values resolved."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    batched: bool


def loader_settings(cfg: DataConfig, device_type: str, cpus_per_task: int,
                    decodes: bool = False) -> LoaderSettings:
    """Resolve the auto (None) loader options for a rank on ``device_type`` (pure);
    ``decodes``: the samples are files to decode (image_folder, shards)."""
    cuda = device_type == "cuda"
    workers = cfg.num_workers
    if workers is None:
        # CPU: the model needs every core of the task, and slicing a batch costs microseconds.
        # CUDA: the main process launches kernels; slicing and pinning move to workers, and
        # decoding files takes every core there is.
        most = MAX_DECODE_WORKERS if decodes else MAX_AUTO_WORKERS
        workers = min(max(cpus_per_task - 1, 1 if decodes else 0), most) if cuda else 0
    pin = cuda if cfg.pin_memory is None else cfg.pin_memory and cuda
    return LoaderSettings(num_workers=workers, pin_memory=pin,
                          persistent_workers=cfg.persistent_workers and workers > 0,
                          prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
                          batched=cfg.batched)


def build_loaders(cfg: DataConfig, batch_size: int, rank: int, world_size: int, seed: int,
                  device_type: str = "cpu", cpus_per_task: int = 1,
                  sets: DataSets | None = None, planned: int | None = None) -> Loaders:
    """This rank's train and eval loaders (``sets``: the data sets, when already built;
    ``planned``: the ranks the run was planned with, for the global order that keeps each
    step's samples at any world size, data/global_order.py)."""

    sets = sets or build_datasets(cfg, seed, rank, world_size)
    settings = loader_settings(cfg, device_type, cpus_per_task, sets.decodes)
    train_set, eval_set = sets.train, sets.eval
    # A generator of its own: creating a loader iterator then leaves the global RNG alone,
    # so a run resumed mid-epoch draws the same random numbers as an uninterrupted one.
    loader_gen = torch.Generator().manual_seed(seed + 1_000 * rank)
    if sets.iterable:
        return _iterable_loaders(sets, batch_size, settings, loader_gen,
                                 cfg.decoder == "cuda" and device_type == "cuda", planned)
    # The batched path needs a data set that gives a whole batch for a list of indices.
    batched = settings.batched and isinstance(train_set, ImageTensorDataset) and (
        eval_set is None or isinstance(eval_set, ImageTensorDataset))
    settings = dataclasses.replace(settings, batched=batched)
    sampler: ResumableDistributedSampler | GlobalBatches = (
        GlobalBatches(len(train_set), batch_size, planned, world_size, rank, seed) if planned
        else ResumableDistributedSampler(train_set, world_size, rank, seed))
    common: dict[str, Any] = dict(num_workers=settings.num_workers,
                                  pin_memory=settings.pin_memory,
                                  persistent_workers=settings.persistent_workers)
    if settings.prefetch_factor is not None:
        common["prefetch_factor"] = settings.prefetch_factor
    shard = eval_shard(len(eval_set), rank, world_size) if eval_set is not None else []
    train: Any
    if isinstance(sampler, GlobalBatches):  # it gives the batches: lists of indices
        train = (DataLoader(train_set, sampler=sampler, batch_size=None,  # type: ignore[arg-type]
                            generator=loader_gen, **common) if settings.batched
                 else DataLoader(train_set, batch_sampler=sampler, generator=loader_gen,
                                 **common))
    elif settings.batched:
        # batch_size=None: the data set receives each list of indices and returns the batch.
        train = DataLoader(train_set, sampler=BatchedSampler(sampler, batch_size),  # type: ignore[arg-type]
                           batch_size=None, generator=loader_gen, **common)
    else:  # the textbook path: one __getitem__ per sample, then default_collate
        train = DataLoader(train_set, sampler=sampler, generator=loader_gen,  # type: ignore[arg-type]
                           batch_size=batch_size, **common)
    evaluation: Any = None
    if eval_set is not None and settings.batched:
        evaluation = DataLoader(eval_set, sampler=BatchedSampler(shard, batch_size),  # type: ignore[arg-type]
                                batch_size=None, **common)
    elif eval_set is not None:
        evaluation = DataLoader(Subset(eval_set, shard), batch_size=batch_size,  # type: ignore[arg-type]
                                shuffle=False, **common)
    return Loaders(train, evaluation, sampler, sets, settings)


def _iterable_loaders(sets: DataSets, batch_size: int, settings: LoaderSettings,
                      loader_gen: Any, gpu_decode: bool = False,
                      planned: int | None = None) -> Loaders:
    """An IterableDataset shards itself per rank (and per worker, if it uses workers); shards
    make whole batches in the workers (``gpu_decode``: encoded, decoded on the GPU) and,
    with ``planned`` ranks, take the global order (shards.py; a data set of yours keeps its
    own order)."""

    sampler = (sets.train.use_global_order(batch_size, planned)
               if planned and hasattr(sets.train, "use_global_order") else None)

    common: dict[str, Any] = dict(num_workers=settings.num_workers,
                                  pin_memory=settings.pin_memory,
                                  persistent_workers=settings.persistent_workers)
    if settings.prefetch_factor is not None:
        common["prefetch_factor"] = settings.prefetch_factor
    settings = dataclasses.replace(settings, batched=hasattr(sets.train, "batches"))

    def loader(dataset: Any, **extra: Any) -> Any:
        if not hasattr(dataset, "batches"):
            return DataLoader(dataset, batch_size=batch_size, **common, **extra)
        made = DataLoader(dataset.batches(batch_size, raw=gpu_decode), batch_size=None,
                          **common, **extra)
        if gpu_decode:

            return GpuDecoded(made, dataset.image_size)
        return made

    evaluation = loader(sets.eval) if sets.eval is not None else None
    return Loaders(loader(sets.train, generator=loader_gen), evaluation, sampler, sets,
                   settings)
