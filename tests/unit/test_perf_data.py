"""The fast data path gives the textbook path's batches, and the loader's auto settings."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hpc_ddp.config.schema import DataConfig
from hpc_ddp.data.loaders import build_loaders, loader_settings
from hpc_ddp.data.tensor_dataset import MEAN, STD, ImageTensorDataset
from hpc_ddp.trainer.augment import flip_and_crop, normalize


def _batches(loader: object) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.clone(), y.clone()) for x, y in loader]  # type: ignore[attr-defined]


@pytest.mark.parametrize("rank, start", [(0, 0), (1, 0), (1, 37)])
def test_batched_loader_gives_the_per_sample_loaders_batches(rank: int, start: int) -> None:
    made = {}
    for batched in (True, False):
        cfg = DataConfig(train_size=203, eval_size=41, batched=batched)
        loaders = build_loaders(cfg, batch_size=16, rank=rank, world_size=2, seed=5)
        loaders.sampler.set_position(epoch=3, start=start)
        made[batched] = (_batches(loaders.train), _batches(loaders.eval))
    for fast, plain in zip(made[True], made[False], strict=True):
        assert len(fast) == len(plain) > 0
        for (xa, ya), (xb, yb) in zip(fast, plain, strict=True):
            assert torch.equal(xa, xb) and torch.equal(ya, yb)
            assert xa.dtype == torch.uint8 and xa.is_contiguous()


def test_workers_do_not_change_the_batches() -> None:
    made = []
    for workers in (0, 2):
        cfg = DataConfig(train_size=150, eval_size=20, num_workers=workers)
        loaders = build_loaders(cfg, batch_size=16, rank=0, world_size=2, seed=1)
        loaders.sampler.set_position(epoch=1, start=8)
        made.append(_batches(loaders.train))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
               for a, b in zip(*made, strict=True))


def test_dataset_gives_a_sample_or_a_whole_batch() -> None:
    data = ImageTensorDataset(torch.arange(5 * 3 * 2 * 2, dtype=torch.uint8).view(5, 3, 2, 2),
                              torch.arange(5))
    image, label = data[3]
    assert image.shape == (3, 2, 2) and int(label) == 3
    images, labels = data[[4, 0, 4]]
    assert images.shape == (3, 3, 2, 2) and labels.tolist() == [4, 0, 4]
    assert torch.equal(images[1], data[0][0])


@pytest.mark.parametrize("cfg, device, cpus, expected", [
    (DataConfig(), "cpu", 8, (0, False, False, None)),
    (DataConfig(), "cuda", 1, (0, True, False, None)),
    (DataConfig(), "cuda", 3, (2, True, True, None)),
    (DataConfig(), "cuda", 32, (4, True, True, None)),
    (DataConfig(num_workers=3, pin_memory=True, prefetch_factor=4), "cpu", 1,
     (3, False, True, 4)),  # pinning needs CUDA
    (DataConfig(num_workers=2, pin_memory=False, persistent_workers=False), "cuda", 8,
     (2, False, False, None)),
    (DataConfig(num_workers=0, prefetch_factor=4), "cuda", 8, (0, True, False, None)),
])
def test_loader_auto_settings(cfg: DataConfig, device: str, cpus: int,
                              expected: tuple[int, bool, bool, int | None]) -> None:
    s = loader_settings(cfg, device, cpus)
    assert (s.num_workers, s.pin_memory, s.persistent_workers, s.prefetch_factor) == expected


def _flip_and_crop_reference(images: torch.Tensor, gen: torch.Generator,
                             pad: int = 4) -> torch.Tensor:
    """The per-sample loop the vectorised version replaced."""
    n, _, h, w = images.shape
    flips = torch.rand(n, generator=gen) < 0.5
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=gen)
    out = images.clone()
    out[flips] = out[flips].flip(3)
    padded = F.pad(out, (pad, pad, pad, pad))
    for i in range(n):
        dy, dx = int(offsets[i, 0]), int(offsets[i, 1])
        out[i] = padded[i, :, dy:dy + h, dx:dx + w]
    return out


@pytest.mark.parametrize("shape", [(64, 3, 32, 32), (5, 3, 9, 13)])
def test_flip_and_crop_is_the_per_sample_loop_bitwise(shape: tuple[int, ...]) -> None:
    images = torch.randint(0, 256, shape, dtype=torch.uint8)
    ours = flip_and_crop(images, torch.Generator().manual_seed(7))
    reference = _flip_and_crop_reference(images, torch.Generator().manual_seed(7))
    assert torch.equal(ours, reference)
    gen = torch.Generator().manual_seed(7)
    flip_and_crop(images, gen)  # draws exactly what the loop drew
    ref_gen = torch.Generator().manual_seed(7)
    _flip_and_crop_reference(images, ref_gen)
    assert torch.equal(gen.get_state(), ref_gen.get_state())


def test_normalize_matches_the_textbook_formula() -> None:
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    textbook = (images.float() / 255 - mean) / std
    plain, last = normalize(images), normalize(images, channels_last=True)
    assert torch.allclose(plain, textbook, atol=1e-5) and plain.dtype == torch.float32
    assert plain.is_contiguous() and last.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(plain, last)
