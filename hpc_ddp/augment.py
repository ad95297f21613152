"""Per-batch image work on the device: uint8 -> normalised float, optional augmentation.

Augmentation draws from a Generator the trainer checkpoints, so a resumed run applies the
same crops and flips an uninterrupted run would.
"""

from __future__ import annotations

from typing import Any

from hpc_ddp.data.tensor_dataset import MEAN, STD


def normalize(images: Any, channels_last: bool = False) -> Any:
    import torch

    x = images.float().div_(255.0)
    mean = torch.tensor(MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def flip_and_crop(images: Any, gen: Any, pad: int = 4) -> Any:
    """Random horizontal flip and a random ``pad``-pixel crop, per sample (uint8 in, out)."""
    import torch
    import torch.nn.functional as F

    n, _, h, w = images.shape
    flips = torch.rand(n, generator=gen) < 0.5
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
    out = images.clone()
    out[flips.to(images.device)] = out[flips.to(images.device)].flip(3)
    padded = F.pad(out, (pad, pad, pad, pad))
    for i in range(n):
        dy, dx = int(offsets[i, 0]), int(offsets[i, 1])
        out[i] = padded[i, :, dy:dy + h, dx:dx + w]
    return out
