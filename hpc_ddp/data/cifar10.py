"""CIFAR-10 read by torchvision's own loader from a data root; ranks never download."""

from __future__ import annotations

import pickle
from pathlib import Path

from hpc_ddp.data.tensor_dataset import ImageTensorDataset
from hpc_ddp.errors import UserError

FOLDER = "cifar-10-batches-py"


def check_root(root: str) -> Path:
    """The data root, or UserError saying how to fetch the data (checked before launch)."""
    path = Path(root).expanduser()
    if not path.exists():
        raise UserError("data.root", root, "does not exist.", "check the path, or fetch the "
                        "data set there once on a login node: python -m hpc_ddp.data download "
                        f"cifar10 root={root}")
    if not (path / FOLDER).is_dir():
        raise UserError(
            "data.root", root, f"holds no {FOLDER}/ folder.",
            f"fetch it once on a login node: python -m hpc_ddp.data download cifar10 root={root}",
        )
    return path


def _reader(verify_checksum: bool) -> type:
    from torchvision.datasets import CIFAR10  # deferred: torchvision

    if verify_checksum:
        return CIFAR10

    class CIFAR10Unverified(CIFAR10):  # type: ignore[misc]
        """torchvision's reader with the MD5 check reduced to "the files exist"."""

        def _check_integrity(self) -> bool:
            folder = Path(self.root) / self.base_folder
            return all((folder / name).is_file() for name, _ in self.train_list + self.test_list)

        def _load_meta(self) -> None:  # the same reading as torchvision's, minus the MD5

            with open(Path(self.root) / self.base_folder / self.meta["filename"], "rb") as f:
                self.classes = pickle.load(f, encoding="latin1")[self.meta["key"]]
            self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    return CIFAR10Unverified


def load_split(root: str, train: bool, verify_checksum: bool = True) -> ImageTensorDataset:
    """The train (50000) or test (10000) split as uint8 NCHW tensors."""
    import torch  # deferred: torch

    path = check_root(root)
    try:
        # download=False: a rank must never reach the internet (nodes often cannot, and 64
        # ranks downloading at once corrupt the folder).
        dataset = _reader(verify_checksum)(str(path), train=train, download=False)
    except RuntimeError as exc:
        raise UserError("data.root", root, f"CIFAR-10 there is unreadable ({exc}).",
                        "download it again (python -m hpc_ddp.data download cifar10), or set "
                        "data.verify_checksum=false for a copy you changed on purpose.") from None
    images = torch.from_numpy(dataset.data).permute(0, 3, 1, 2).contiguous()
    labels = torch.tensor(dataset.targets, dtype=torch.int64)
    return ImageTensorDataset(images, labels)


def download(root: str) -> Path:
    """Fetch CIFAR-10 into ``root`` (for a login node with internet)."""
    from torchvision.datasets import CIFAR10  # deferred: torchvision

    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    for train in (True, False):
        CIFAR10(str(path), train=train, download=True)
    return path
