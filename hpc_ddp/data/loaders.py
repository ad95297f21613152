"""Build the datasets and loaders a rank trains and evaluates on.

The loader settings left on auto (``None`` in :class:`DataConfig`) are chosen here from the
device and the task's CPUs (:func:`loader_settings`); docs/performance.md has the measurements
behind each choice. None of them changes which samples a batch holds or their order: the
sampler runs in the main process and workers only slice the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_ddp.config.schema import DataConfig
from hpc_ddp.data.sampler import ResumableDistributedSampler, eval_shard
from hpc_ddp.data.tensor_dataset import BatchedSampler, ImageTensorDataset

# Workers beyond this feed no GPU faster: a batch is a slice of memory, not a decoded file.
MAX_AUTO_WORKERS = 4


@dataclass
class Loaders:
    train: Any
    eval: Any
    sampler: ResumableDistributedSampler
    train_size: int
    eval_size: int
    settings: LoaderSettings | None = None


@dataclass(frozen=True)
class LoaderSettings:
    """The DataLoader options in effect, auto values resolved."""

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    prefetch_factor: int | None
    batched: bool


def loader_settings(cfg: DataConfig, device_type: str, cpus_per_task: int) -> LoaderSettings:
    """Resolve the auto (None) loader options for a rank on ``device_type`` (pure)."""
    cuda = device_type == "cuda"
    workers = cfg.num_workers
    if workers is None:
        # CPU: the model needs every core of the task, and slicing a batch costs microseconds.
        # CUDA: the main process launches kernels; slicing and pinning move to workers.
        workers = min(max(cpus_per_task - 1, 0), MAX_AUTO_WORKERS) if cuda else 0
    pin = cuda if cfg.pin_memory is None else cfg.pin_memory and cuda
    return LoaderSettings(num_workers=workers, pin_memory=pin,
                          persistent_workers=cfg.persistent_workers and workers > 0,
                          prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
                          batched=cfg.batched)


def build_datasets(cfg: DataConfig, seed: int) -> tuple[ImageTensorDataset, ImageTensorDataset]:
    if cfg.name == "synthetic":
        from hpc_ddp.data.synthetic import make_split

        return (make_split(seed, cfg.train_size, cfg.noise, 0, cfg.image_size),
                make_split(seed, cfg.eval_size, cfg.noise, 1, cfg.image_size))
    from hpc_ddp.data.cifar10 import load_split

    assert cfg.root is not None  # validate() guarantees it
    return (load_split(cfg.root, True, cfg.verify_checksum),
            load_split(cfg.root, False, cfg.verify_checksum))


def build_loaders(cfg: DataConfig, batch_size: int, rank: int, world_size: int, seed: int,
                  device_type: str = "cpu", cpus_per_task: int = 1) -> Loaders:
    import torch
    from torch.utils.data import DataLoader, Subset

    settings = loader_settings(cfg, device_type, cpus_per_task)
    train_set, eval_set = build_datasets(cfg, seed)
    sampler = ResumableDistributedSampler(train_set, world_size, rank, seed)
    # A generator of its own: creating a loader iterator then leaves the global RNG alone,
    # so a run resumed mid-epoch draws the same random numbers as an uninterrupted one.
    loader_gen = torch.Generator().manual_seed(seed + 1_000 * rank)
    common: dict[str, Any] = dict(num_workers=settings.num_workers,
                                  pin_memory=settings.pin_memory,
                                  persistent_workers=settings.persistent_workers)
    if settings.prefetch_factor is not None:
        common["prefetch_factor"] = settings.prefetch_factor
    shard = eval_shard(len(eval_set), rank, world_size)
    train: Any
    evaluation: Any
    if settings.batched:
        # batch_size=None: the data set receives each list of indices and returns the batch.
        train = DataLoader(train_set, sampler=BatchedSampler(sampler, batch_size),  # type: ignore[arg-type]
                           batch_size=None, generator=loader_gen, **common)
        evaluation = DataLoader(eval_set, sampler=BatchedSampler(shard, batch_size),  # type: ignore[arg-type]
                                batch_size=None, **common)
    else:  # the textbook path: one __getitem__ per sample, then default_collate
        train = DataLoader(train_set, sampler=sampler, generator=loader_gen,  # type: ignore[arg-type]
                           batch_size=batch_size, **common)
        evaluation = DataLoader(Subset(eval_set, shard), batch_size=batch_size,  # type: ignore[arg-type]
                                shuffle=False, **common)
    return Loaders(train, evaluation, sampler, len(train_set), len(eval_set), settings)
