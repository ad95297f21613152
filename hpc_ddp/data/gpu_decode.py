"""``data.decoder=cuda``: shards' JPEGs decoded on the rank's GPU (nvJPEG, through
torchvision.io.decode_jpeg(device="cuda")), cropped and resized there.

The loader workers only read each sample's bytes and draw its crop box (from the sample's own
seed, as the CPU path does: the same boxes); this wrapper, in the training process, decodes a
whole batch in one call and returns uint8 [N, 3, S, S] on the GPU, so the CPU cores that
decoding would take are free. Boxes and flips are the CPU path's; pixels may differ from the
CPU decoder's by rounding (nvJPEG's IDCT and upsampling, and a float resize).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any


class GpuDecoded:
    """Iterates a DataLoader of raw shard batches, yielding decoded GPU batches."""

    def __init__(self, loader: Any, image_size: int, device: Any = "cuda") -> None:
        self.loader, self.image_size, self.device = loader, image_size, device

    @property
    def generator(self) -> Any:  # the trainer checkpoints the loader's generator
        return self.loader.generator

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for datas, labels, boxes in self.loader:
            yield decode_batch(datas, boxes, self.image_size, self.device), labels


def decode_batch(datas: list[Any], boxes: list[tuple[int, int, int, int, bool]],
                 size: int, device: Any) -> Any:
    """Encoded JPEGs (uint8 CPU tensors) -> uint8 [N, 3, size, size] on ``device``."""
    # deferred: torch, torchvision
    import torch
    import torch.nn.functional as F
    from torchvision.io import ImageReadMode, decode_jpeg

    with warnings.catch_warnings():  # torchvision 0.29 warns on every call (TorchCodec)
        warnings.simplefilter("ignore", DeprecationWarning)
        decoded = decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
    out = torch.empty((len(datas), 3, size, size), dtype=torch.uint8, device=device)
    for i, (image, (top, left, h, w, flip)) in enumerate(zip(decoded, boxes, strict=True)):
        region = image[:, top:top + h, left:left + w].unsqueeze(0).float()
        if (h, w) != (size, size):
            region = F.interpolate(region, size=(size, size), mode="bilinear",
                                   antialias=True, align_corners=False)
        region = region[0].round_().clamp_(0, 255)
        out[i] = region.flip(-1) if flip else region
    return out
