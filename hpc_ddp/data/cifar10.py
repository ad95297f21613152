"""CIFAR-10 read by torchvision's own loader from a data root; ranks never download."""

from __future__ import annotations

from pathlib import Path

from hpc_ddp.data.tensor_dataset import ImageTensorDataset
from hpc_ddp.errors import UserError

FOLDER = "cifar-10-batches-py"


def check_root(root: str) -> Path:
    """The data root, or UserError saying how to fetch the data (checked before launch)."""
    path = Path(root).expanduser()
    if not (path / FOLDER).is_dir():
        raise UserError(
            "data.root", root, f"holds no {FOLDER}/ folder.",
            f"fetch it once on a login node: python -m hpc_ddp.data download cifar10 root={root}",
        )
    return path


def load_split(root: str, train: bool) -> ImageTensorDataset:
    """The train (50000) or test (10000) split as uint8 NCHW tensors."""
    import torch
    from torchvision.datasets import CIFAR10

    path = check_root(root)
    try:
        # download=False: a rank must never reach the internet (nodes often cannot, and 64
        # ranks downloading at once corrupt the folder). The checksum check stays on.
        dataset = CIFAR10(str(path), train=train, download=False)
    except RuntimeError as exc:
        raise UserError("data.root", root, f"CIFAR-10 there is unreadable ({exc}).",
                        "download it again with python -m hpc_ddp.data download cifar10.") from None
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor(dataset.targets, dtype=torch.int64)
    return ImageTensorDataset(images, labels)


def download(root: str) -> Path:
    """Fetch CIFAR-10 into ``root`` (for a login node with internet)."""
    from torchvision.datasets import CIFAR10

    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        CIFAR10(str(path), train=train, download=True)
    return path
