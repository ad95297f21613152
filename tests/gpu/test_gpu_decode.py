"""data.decoder=cuda on a GPU: shards' JPEGs decoded by nvJPEG, cropped on the device, the
same boxes as the CPU path. Skipped without CUDA; scripts/gpu_check.sh runs tests/gpu."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_cuda_decoding_gives_the_cpu_paths_batches(tmp_path: Path) -> None:
    from torch.utils.data import DataLoader

    from hpc_ddp.config.compose import compose
    from hpc_ddp.data import fake_images, pack
    from hpc_ddp.data.loaders import build_loaders
    from hpc_ddp.data.shards import ShardSet

    fake_images.write_folder(tmp_path / "src", 3, {"train": 12, "val": 2}, (160, 120))
    pack.pack_folder(str(tmp_path / "src"), str(tmp_path / "shards"), samples_per_shard=8)
    cfg = compose(["data=shards", f"data.root={tmp_path / 'shards'}", "data.image_size=64",
                   "data.decoder=cuda", "data.num_workers=2"])
    loaders = build_loaders(cfg.data, 8, 0, 1, 0, device_type="cuda", cpus_per_task=3)
    loaders.set_position(0, 0)
    gpu = list(loaders.train)
    cpu_set = ShardSet(str(tmp_path / "shards"), "train", 0, 1, 0, 64, True, True, "pil", 8192)
    cpu = list(DataLoader(cpu_set.batches(8), batch_size=None))
    assert len(gpu) == len(cpu) == 5
    for (a, la), (b, lb) in zip(cpu, gpu, strict=True):
        assert b.device.type == "cuda" and b.dtype == torch.uint8 and b.shape == a.shape
        assert torch.equal(la, lb.cpu())
        assert (a.float() - b.cpu().float()).abs().mean() < 4  # nvJPEG's IDCT: rounding
