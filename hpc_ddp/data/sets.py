"""The train and eval data sets a config names: built in (synthetic, cifar10, image_folder,
shards) or built by a user's `_target_` factory.

A factory returns ``(train, eval)``, ``{"train": ..., "eval": ...}`` or an object with
``.train`` / ``.eval``; eval may be None (no evaluation). Each set is a map-style Dataset
(``__len__`` and ``__getitem__``), split across ranks by hpc_ddp's sampler, or an
IterableDataset that shards itself per rank (the factory gets ``rank`` and ``world_size``
when it takes them) and has a ``__len__`` (its samples on this rank), so that every rank runs
the same number of steps. ``num_classes`` comes from the data where it says: a ``classes``
list or a ``num_classes`` attribute.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hpc_ddp.config.schema import DataConfig

# What a factory may take and is given when its config leaves it unset.
FACTORY_ARGUMENTS = ("rank", "world_size", "seed")


@dataclass
class DataSets:
    train: Any
    eval: Any | None
    num_classes: int | None = None
    # uint8 images to normalise on the device with these (mean, std) of [0, 1] pixels;
    # None: batches are used as the data set gives them.
    stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # Random crop and flip of whole uint8 batches on the device (synthetic/cifar10 augment).
    batch_augment: bool = False
    # Samples are files to decode (image_folder, shards): loader workers pay off on any device.
    decodes: bool = False

    @property
    def iterable(self) -> bool:
        from torch.utils.data import IterableDataset  # deferred: torch

        return isinstance(self.train, IterableDataset)


def build_datasets(cfg: DataConfig, seed: int, rank: int = 0, world_size: int = 1) -> DataSets:
    """The data sets of this rank (only an iterable data set differs between ranks)."""
    if cfg.target is not None:
        return _from_factory(cfg, seed, rank, world_size)
    if cfg.name == "synthetic":
        # deferred (start-up): data.synthetic, data.tensor_dataset
        from hpc_ddp.data.synthetic import make_split
        from hpc_ddp.data.tensor_dataset import MEAN, STD

        return DataSets(make_split(seed, cfg.train_size, cfg.noise, 0, cfg.image_size),
                        make_split(seed, cfg.eval_size, cfg.noise, 1, cfg.image_size),
                        10, (MEAN, STD), cfg.augment)
    assert cfg.root is not None  # validate() guarantees it
    if cfg.name == "image_folder":
        from hpc_ddp.data import image_folder  # deferred (start-up): data.image_folder

        classes = image_folder.check_root(cfg.root, (cfg.train_split, cfg.eval_split))
        return DataSets(
            image_folder.load_split(cfg.root, cfg.train_split, cfg.image_size, cfg.augment,
                                    seed, cfg.decoder),
            image_folder.load_split(cfg.root, cfg.eval_split, cfg.image_size, False, seed,
                                    cfg.decoder),
            len(classes[cfg.train_split]), (image_folder.MEAN, image_folder.STD),
            decodes=True)
    if cfg.name == "shards":
        # deferred: torch; start-up: data.images
        from hpc_ddp.data import images
        from hpc_ddp.data.shards import ShardSet

        decoder = "auto" if cfg.decoder == "cuda" else cfg.decoder  # cuda: on the batch
        train, evaluation = (ShardSet(cfg.root, split, rank, world_size, seed, cfg.image_size,
                                      split == cfg.train_split, cfg.augment, decoder,
                                      cfg.shuffle_buffer)
                             for split in (cfg.train_split, cfg.eval_split))
        return DataSets(train, evaluation, len(train.classes) or None,
                        (images.MEAN, images.STD), decodes=True)
    # deferred (start-up): data.cifar10, data.tensor_dataset
    from hpc_ddp.data.cifar10 import load_split
    from hpc_ddp.data.tensor_dataset import MEAN, STD

    return DataSets(load_split(cfg.root, True, cfg.verify_checksum),
                    load_split(cfg.root, False, cfg.verify_checksum), 10, (MEAN, STD),
                    cfg.augment)


def _from_factory(cfg: DataConfig, seed: int, rank: int, world_size: int) -> DataSets:
    from hpc_ddp.targets import TargetError, build  # deferred (start-up): targets

    assert cfg.target is not None
    made = build("data", cfg.target, cfg.kwargs,
                 auto={"rank": rank, "world_size": world_size, "seed": seed})
    if isinstance(made, Mapping):
        train, evaluation = made.get("train"), made.get("eval")
    elif isinstance(made, tuple | list) and len(made) == 2:
        train, evaluation = made
    elif hasattr(made, "train"):
        train, evaluation = made.train, getattr(made, "eval", None)
    else:
        raise TargetError("data._target_", cfg.target, f"returned a {type(made).__name__}, "
                          "not the train and eval data sets.",
                          "return (train, eval), {'train': ..., 'eval': ...} or an object with "
                          ".train and .eval (eval may be None).")
    for split, dataset in (("train", train), ("eval", evaluation)):
        if dataset is None and split == "eval":
            continue
        check_dataset(dataset, split, cfg.target)
    return DataSets(train, evaluation, num_classes_of(made) or num_classes_of(train))


def check_dataset(dataset: Any, split: str, target: str) -> None:
    """A usable data set: map-style with items, or iterable with a length (TargetError)."""
    from torch.utils.data import IterableDataset  # deferred: torch; start-up: targets

    from hpc_ddp.targets import TargetError

    key = "data._target_"
    if isinstance(dataset, IterableDataset):
        if not hasattr(dataset, "__len__"):
            raise TargetError(key, target, f"its {split} set is an IterableDataset without "
                              "__len__, so the ranks cannot agree on the steps of an epoch.",
                              "give it __len__ (its samples on this rank, equal on every rank), "
                              "or return a map-style Dataset, which hpc_ddp shards itself.")
    elif not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TargetError(key, target, f"its {split} set is a {type(dataset).__name__}, not a "
                          "Dataset (__len__ and __getitem__, or an IterableDataset).",
                          "return torch.utils.data.Dataset objects.")
    try:
        size = len(dataset)
    except TypeError as exc:
        raise TargetError(key, target, f"len() of its {split} set failed ({exc}).",
                          "make __len__ return the number of samples.") from None
    if size <= 0:
        raise TargetError(key, target, f"its {split} set is empty.",
                          "check the factory's arguments (a path, a size) under data.")


def num_classes_of(obj: Any) -> int | None:
    """Classes a data set (or the factory's result) says it has, if it says."""
    classes = getattr(obj, "classes", None)
    if isinstance(classes, list | tuple) and classes:
        return len(classes)
    count = getattr(obj, "num_classes", None)
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else None


def describe(sets: DataSets) -> str:
    """"4096 train / 1024 eval samples, 10 classes" (for logs and checks)."""
    evaluation = f"{len(sets.eval)} eval" if sets.eval is not None else "no eval"
    classes = f", {sets.num_classes} classes" if sets.num_classes else ""
    return f"{len(sets.train)} train / {evaluation} samples{classes}"


def first_batch(dataset: Any, batch_size: int) -> Any:
    """A batch of the first samples of ``dataset`` (for a warm-up step; not a training batch)."""

    # deferred: torch; start-up: data.tensor_dataset
    from torch.utils.data import IterableDataset, default_collate

    from hpc_ddp.data.tensor_dataset import ImageTensorDataset

    count = min(batch_size, len(dataset))
    if isinstance(dataset, ImageTensorDataset):
        return dataset[list(range(count))]
    if isinstance(dataset, IterableDataset):
        return default_collate(list(itertools.islice(iter(dataset), count)))
    return default_collate([dataset[i] for i in range(count)])
