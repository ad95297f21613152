"""Images kept as uint8 NCHW tensors; normalisation happens per batch on the device.

uint8 keeps a rank's copy of CIFAR-10 at 150 MB instead of 600 MB of float32.
"""

from __future__ import annotations

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

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        return self.images[index], self.labels[index]

    def __getitems__(self, indices: list[int]) -> list[tuple[Any, Any]]:
        # DataLoader's batched fetch: one gather instead of one index per sample.
        images, labels = self.images[indices], self.labels[indices]
        return list(zip(images, labels, strict=True))
