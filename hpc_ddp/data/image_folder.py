"""Images in ImageNet's folder layout: ``root/<split>/<class>/<image>`` (JPEG or PNG).

torchvision's ImageFolder finds the files and the classes (sorted folder names); each file is
decoded by the fastest decoder at hand and cropped on uint8 tensors (images.py), so a batch
leaves the loader as uint8 [N, 3, S, S] and is normalised on the device, like the other image
data sets. Training: a random resized crop and a horizontal flip (``augment``); evaluation: a
resize to S / 0.875 and a centre crop (the usual ImageNet recipe). Each sample's random draws
come from the run's seed, the epoch and the sample's number (images.sample_random), so a
resumed run draws the same ones whatever the number of loader workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpc_ddp.data import images
from hpc_ddp.errors import UserError

MEAN, STD = images.MEAN, images.STD
EXTENSIONS = (".jpg", ".jpeg", ".png", ".JPG", ".JPEG", ".PNG")


def check_root(root: str, splits: tuple[str, ...]) -> dict[str, list[str]]:
    """The classes of each split, read from the folder names only (no file is opened);
    UserError naming what is missing. Both splits must have the same classes."""
    base = Path(root).expanduser()
    if not base.exists():
        raise UserError("data.root", root, "does not exist.", "point data.root at the folder "
                        "with the split folders (ImageNet layout: train/<class>/*.jpg, "
                        "val/<class>/*.jpg), on a file system the nodes share.")
    found: dict[str, list[str]] = {}
    for split in splits:
        folder = base / split
        if not folder.is_dir():
            raise UserError("data.root", root, f"holds no {split}/ folder.",
                            "point data.root at the folder with the split folders (ImageNet "
                            "layout: train/<class>/*.jpg, val/<class>/*.jpg), or set "
                            "data.train_split / data.eval_split to their names.")
        classes = sorted(p.name for p in folder.iterdir() if p.is_dir())
        if not classes:
            raise UserError("data.root", root, f"{split}/ holds no class folders.",
                            f"put each class's images in {split}/<class name>/.")
        found[split] = classes
    first, *rest = splits
    for split in rest:
        if found[split] != found[first]:
            only = sorted(set(found[first]) ^ set(found[split]))
            raise UserError("data.root", root, f"{first}/ and {split}/ have different class "
                            f"folders ({', '.join(only[:5])}{' ...' if len(only) > 5 else ''}).",
                            "give both splits the same class folders (empty ones included).")
    return found


class ImageFiles:
    """(uint8 [3, S, S], label) per file of ``root/split``; ``set_epoch`` changes the crops
    (through shared memory, so loader workers that persist between epochs see it too)."""

    def __init__(self, folder: str, size: int, train: bool, seed: int, decoder: str) -> None:
        # deferred: torch, torchvision
        import torch
        from torchvision.datasets import ImageFolder

        found = ImageFolder(folder, loader=_unused, is_valid_file=is_image)
        self.samples: list[tuple[str, int]] = found.samples
        self.classes: list[str] = found.classes
        self.size, self.train, self.seed, self.decoder = size, train, seed, decoder
        self._epoch = torch.zeros(1, dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self._epoch[0] = epoch

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, label = self.samples[index]
        with open(path, "rb") as handle:
            data = handle.read()
        image = images.load(data, images.decoder(self.decoder), self.size, self.train,
                            self.seed, int(self._epoch[0]), index)
        return image, label


def load_split(root: str, split: str, image_size: int, train: bool, seed: int = 0,
               decoder: str = "auto") -> ImageFiles:
    """The files of ``root/split`` with our decoder and crops."""
    images.resolve_decoder(decoder)  # a decoder that is not installed fails here, once
    try:
        return ImageFiles(str(Path(root).expanduser() / split), image_size, train, seed,
                          decoder)
    except FileNotFoundError as exc:  # a class folder without images
        raise UserError("data.root", root, f"{split}/: {exc}.",
                        "every class folder needs at least one .jpg/.jpeg/.png file.") from None


def _unused(path: str) -> Any:
    raise AssertionError("ImageFiles reads the files itself")


def is_image(path: str) -> bool:
    return path.endswith(EXTENSIONS)
