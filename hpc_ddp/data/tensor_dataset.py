"""Images kept as uint8 NCHW tensors; normalisation happens per batch on the device.

uint8 keeps a rank's copy of CIFAR-10 at 150 MB instead of 600 MB of float32. Indexed by an
int, the data set gives one sample (what a plain DataLoader asks for, then collates); indexed
by a list of indices, it gives the whole batch as one slice of each tensor
(:class:`BatchedSampler` asks for that: no per-sample calls and no collate copy).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

# CIFAR-10's per-channel statistics (also used for the synthetic set, which mimics it).
MEAN = (0.4914, 0.4822, 0.4465)
STD = (0.2470, 0.2435, 0.2616)


class ImageTensorDataset:
    """(image uint8 [3,H,W], label int64) pairs backed by two tensors."""

    def __init__(self, images: Any, labels: Any) -> None:
        if images.shape[0] != labels.shape[0]:
            raise ValueError("images and labels differ in length")
        self.images = images
        self.labels = labels

    def __len__(self) -> int:
        return int(self.images.shape[0])

    def __getitem__(self, index: int | Sequence[int]) -> tuple[Any, Any]:
        if isinstance(index, int):
            return self.images[index], self.labels[index]
        import torch  # deferred: torch

        rows = torch.as_tensor(index, dtype=torch.int64)
        # index_select writes one contiguous batch: the copy default_collate would make.
        return self.images.index_select(0, rows), self.labels.index_select(0, rows)


class BatchedSampler:
    """Lists of ``batch_size`` consecutive indices of ``sampler`` (the last one shorter).

    torch's BatchSampler, minus its per-index checks; the DataLoader then asks the data set
    for each whole list at once (``batch_size=None``). The batches are exactly those a
    DataLoader with ``batch_size`` would build from the same sampler.
    """

    def __init__(self, sampler: Any, batch_size: int) -> None:
        self.sampler = sampler
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        indices = list(self.sampler)
        for start in range(0, len(indices), self.batch_size):
            yield indices[start:start + self.batch_size]

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)
