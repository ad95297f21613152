"""Build the datasets and loaders a rank trains and evaluates on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hpc_ddp.config.schema import DataConfig
from hpc_ddp.data.sampler import ResumableDistributedSampler, eval_shard
from hpc_ddp.data.tensor_dataset import ImageTensorDataset


@dataclass
class Loaders:
    train: Any
    eval: Any
    sampler: ResumableDistributedSampler
    train_size: int
    eval_size: int


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
                  pin_memory: bool = False) -> Loaders:
    import torch
    from torch.utils.data import DataLoader, Subset

    train_set, eval_set = build_datasets(cfg, seed)
    sampler = ResumableDistributedSampler(train_set, world_size, rank, seed)
    # A generator of its own: creating a loader iterator then leaves the global RNG alone,
    # so a run resumed mid-epoch draws the same random numbers as an uninterrupted one.
    loader_gen = torch.Generator().manual_seed(seed + 1_000 * rank)
    common: dict[str, Any] = dict(batch_size=batch_size, num_workers=cfg.num_workers,
                                  pin_memory=pin_memory, persistent_workers=cfg.num_workers > 0)
    train: Any = DataLoader(train_set, sampler=sampler, generator=loader_gen,  # type: ignore[arg-type]
                            **common)
    shard: Any = Subset(eval_set, eval_shard(len(eval_set), rank, world_size))  # type: ignore[arg-type]
    evaluation: Any = DataLoader(shard, shuffle=False, **common)
    return Loaders(train, evaluation, sampler, len(train_set), len(eval_set))
