"""Per-batch image work on the device: uint8 -> normalised float, optional augmentation.

Augmentation draws from a Generator the trainer checkpoints, so a resumed run applies the
same crops and flips an uninterrupted run would.
"""

from __future__ import annotations

import functools
from typing import Any

from hpc_ddp.data.tensor_dataset import MEAN, STD

Stats = tuple[tuple[float, ...], tuple[float, ...]]


@functools.lru_cache(maxsize=8)
def _affine(device: Any, stats: Stats = (MEAN, STD)) -> tuple[Any, Any]:
    """(scale, shift) with (x / 255 - mean) / std == x * scale + shift, made once per device
    (a tensor built from a list on every step would be a blocking host-to-GPU copy)."""
    import torch  # deferred: torch

    std = torch.tensor(stats[1], dtype=torch.float64).view(1, 3, 1, 1)
    mean = torch.tensor(stats[0], dtype=torch.float64).view(1, 3, 1, 1)
    scale = (1.0 / (255.0 * std)).to(device=device, dtype=torch.float32)
    shift = (-mean / std).to(device=device, dtype=torch.float32)
    return scale, shift


def prepare_inputs(inputs: Any, stats: Stats | None, channels_last: bool) -> Any:
    """A batch's inputs as the model takes them: uint8 images normalised with ``stats``
    (built-in image data), else as the data set gave them; NHWC for a conv net's 4-d input."""
    import torch  # deferred: torch

    if stats is not None:
        return normalize(inputs, channels_last, stats)
    if channels_last and isinstance(inputs, torch.Tensor) and inputs.dim() == 4:
        return inputs.contiguous(memory_format=torch.channels_last)
    return inputs


def normalize(images: Any, channels_last: bool = False, stats: Stats = (MEAN, STD)) -> Any:
    """uint8 [N,3,H,W] -> float32 normalised by ``stats`` (default: CIFAR-10's)."""
    import torch  # deferred: torch

    if channels_last:  # reorder the uint8 batch (a quarter of the float's bytes)
        images = images.contiguous(memory_format=torch.channels_last)
    scale, shift = _affine(images.device, stats)
    # In place on the fresh float copy: two passes, no temporaries (addcmul on uint8 is
    # slower; the textbook (x / 255 - mean) / std makes four passes and three temporaries).
    return images.float().mul_(scale).add_(shift)


def flip_and_crop(images: Any, gen: Any, pad: int = 4) -> Any:
    """Random horizontal flip and a random ``pad``-pixel crop, per sample (uint8 in, out).

    One gather for the whole batch: sample i is flipped if ``flips[i]``, zero-padded by
    ``pad`` and cut at (offsets[i, 0], offsets[i, 1]) of the padded image.
    """
    # deferred: torch
    import torch
    import torch.nn.functional as F

    n, c, h, w = images.shape
    flips = torch.rand(n, generator=gen) < 0.5
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
    device = images.device
    if device.type == "cuda":  # a pageable copy would make the host wait for the GPU
        flips = flips.pin_memory().to(device, non_blocking=True)
        offsets = offsets.pin_memory().to(device, non_blocking=True)
    padded = F.pad(images, (pad, pad, pad, pad))
    rows = offsets[:, 0:1] + torch.arange(h, device=device)  # [n, h]
    cols = offsets[:, 1:2] + torch.arange(w, device=device)  # [n, w]
    # Flipping before padding equals flipping the padded image (the padding is symmetric).
    cols = torch.where(flips[:, None], w + 2 * pad - 1 - cols, cols)
    # Position of each output pixel in its padded plane; one gather for all planes.
    where = (rows[:, :, None] * (w + 2 * pad) + cols[:, None, :]).view(n, 1, h * w)
    planes = padded.reshape(n, c, -1)
    return planes.gather(2, where.expand(n, c, h * w)).view(n, c, h, w)
