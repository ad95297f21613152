"""CIFAR-10-shaped synthetic data: deterministic from the seed, with learnable classes.

Each class has a smooth random colour pattern (a 4x4 field upsampled to 32x32); a sample is
its class pattern, randomly shifted by up to 3 pixels and scaled in contrast, plus pixel
noise. A small CNN separates the classes within a few dozen steps, far above chance.
"""

from __future__ import annotations

from hpc_ddp.data.tensor_dataset import ImageTensorDataset


def make_split(seed: int, size: int, noise: float, split: int, image_size: int = 32,
               num_classes: int = 10) -> ImageTensorDataset:
    """``size`` samples of split ``split`` (0 train, 1 eval); the same seed gives the same data."""
    # deferred: torch
    import torch
    import torch.nn.functional as F

    # Prototypes depend on the seed only, so train and eval share the class structure.
    proto_gen = torch.Generator().manual_seed(seed)
    protos = torch.randn(num_classes, 3, 4, 4, generator=proto_gen)
    protos = F.interpolate(protos, size=(image_size, image_size), mode="bicubic",
                           align_corners=False)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (split + 1))
    labels = torch.randint(0, num_classes, (size,), generator=gen)
    contrast = 0.7 + 0.6 * torch.rand(size, 1, 1, 1, generator=gen)
    images = protos[labels] * contrast
    shifts = torch.randint(-3, 4, (size, 2), generator=gen)
    for dy in range(-3, 4):
        for dx in range(-3, 4):
            sel = (shifts[:, 0] == dy) & (shifts[:, 1] == dx)
            if sel.any():
                images[sel] = torch.roll(images[sel], shifts=(dy, dx), dims=(2, 3))
    images = images + noise * torch.randn(images.shape, generator=gen)
    pixels = ((images * 0.25 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
    return ImageTensorDataset(pixels, labels.to(torch.int64))
